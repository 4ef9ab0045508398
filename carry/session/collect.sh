#!/bin/bash
# Copy progress (logs, metrics) and each run's latest.pt to $OUT.
cd /root/w || exit 0
tar czf $OUT/progress.tgz.tmp logs runs/*/metrics.jsonl /root/plan.log 2>/dev/null; mv $OUT/progress.tgz.tmp $OUT/progress.tgz
for d in runs/*__ref__*; do
  n=$(basename $d | sed -E 's/BoxPick-(Exact-[34])-v0__ref__([0-9])__.*/\1_ref_s\2/')
  [ -f $d/latest.pt ] && cp $d/latest.pt $OUT/$n.pt.tmp && mv $OUT/$n.pt.tmp $OUT/$n.pt
done
