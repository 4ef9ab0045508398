#!/bin/bash
# Copy progress to $OUT: logs, metrics and eval_adaptive results in progress.tgz, and the checkpoints each plan
# makes (the loops below, one per plan): at most 8 files and 64 MiB come back per call.
cd /root/w || exit 0
tar czf $OUT/progress.tgz.tmp logs runs/*/metrics.jsonl results /root/log_*.log 2>/dev/null; mv $OUT/progress.tgz.tmp $OUT/progress.tgz
copy_out() {  # copy_out FILE [SUFFIX]: to $OUT as e.g. Exact-4_ref_s1.pt, written whole before it takes its name
  local name=$(basename $(dirname $1) | sed -E 's/BoxPick-(Exact-[34]|Generalize-4-[12])-v0__([a-z0-9-]+)__([0-9])__.*/\1_\2_s\3/')$2
  cp $1 $OUT/$name.pt.tmp && mv $OUT/$name.pt.tmp $OUT/$name.pt
}
# plan_resume_ref: the latest.pt of each reference run that trained on this machine (newer than the first plan),
# or its final.pt once it has ended there (5M + 1M; one file a run, so four runs, two pretrained.pt and progress.tgz
# fit; a final.pt carried in for plan_stress_ref is older than the plan and stays)
for d in runs/*__ref__* runs/*__gen-flax__*; do   # the Exact runs are ref, the Generalize ones gen-flax
  if [ -f $d/final.pt ]; then [ $d/final.pt -nt /root/plan.started ] && copy_out $d/final.pt _final
  elif [ $d/latest.pt -nt /root/plan.started ]; then copy_out $d/latest.pt
  fi
done
# and a reference run's pretrained.pt (its IRU-5 at 5M, written when its own FlexLoop phase starts) if written on
# this machine, in the call it appears in and the next (watch.sh and stop_all.sh mark each call's start)
for f in runs/*__ref__*/pretrained.pt runs/*__gen-flax__*/pretrained.pt; do
  [ -f $f ] && [ $f -nt /root/plan.started ] && [ $f -nt /root/call.previous ] && copy_out $f _pretrained
done
# plan_flexloop_ref's final.pt files, until the resume plan runs: its latest.pt files then take the room (an earlier
# call of the lease has brought these back by then)
ls /root/started_plan_resume_ref* > /dev/null 2>&1 || for f in runs/*__ref-lambda1__*/final.pt; do
  [ -f $f ] && copy_out $f
done
# plan_flexloop_1m and plan_selftd_1m: each run's latest.pt while it trains, then its final.pt (the same name,
# so final.pt wins); not once the resume plan runs, whose four latest.pt files need the room
ls /root/started_plan_resume_ref* > /dev/null 2>&1 || for f in runs/*__ref-lambda1-to1m__*/latest.pt runs/*__ref-lambda1-to1m__*/final.pt \
         runs/*__ref-lambda0-1m__*/latest.pt runs/*__ref-lambda0-1m__*/final.pt; do
  [ -f $f ] && [ $f -nt /root/plan.started ] && copy_out $f
done
# plan_selftd_1m from a reference run's pretrained.pt (EXP=ref-5m-lambda0-1m or gen-flax-5m-lambda0-1m): beside
# the resume plan's files
for f in runs/*-5m-lambda0-1m__*/latest.pt runs/*-5m-lambda0-1m__*/final.pt; do
  [ -f $f ] && [ $f -nt /root/plan.started ] && copy_out $f
done
true
