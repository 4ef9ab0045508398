#!/bin/bash
# Keep the call alive for up to $1 seconds, collecting every minute; with a plan name as $2, return early once that
# plan has finished (after a last collection). Then print each log's last lines.
end=$(( $(date +%s) + $1 ))
[ -d /root/w ] || { echo "no /root/w: a fresh machine (the last one went back); nothing to watch. Put the ensure.sh lines before watch.sh"; exit 1; }
[ -f /root/call.started ] && mv /root/call.started /root/call.previous; touch /root/call.started  # collect.sh
while [ $(date +%s) -lt $end ]; do
  left=$(( end - $(date +%s) ))
  sleep $(( left < 60 ? left : 60 ))   # never past $1: the call's timeout is set from it
  finished=0   # the plan has finished for every EXP it was started with (ensure.sh's log_PLAN[_EXP].log)
  if [ -n "$2" ]; then
    finished=1; for f in /root/log_${2%.sh}*.log; do grep -q "plan finished" $f 2>/dev/null || finished=0; done
  fi
  bash carry/session/collect.sh
  [ $finished = 1 ] && break
done
cd /root/w && for f in logs/*.log; do echo "== $f"; tail -c 600 $f; echo; done
nvidia-smi --query-gpu=index,utilization.gpu,memory.used --format=csv
