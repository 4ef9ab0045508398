#!/bin/bash
# Keep the call alive for up to $1 seconds, collecting every minute; with a plan name as $2, return early once that
# plan has finished (after a last collection). Then print each log's last lines.
end=$(( $(date +%s) + $1 ))
[ -f /root/call.started ] && mv /root/call.started /root/call.previous; touch /root/call.started  # collect.sh
while [ $(date +%s) -lt $end ]; do
  left=$(( end - $(date +%s) ))
  sleep $(( left < 60 ? left : 60 ))   # never past $1: the call's timeout is set from it
  finished=$([ -n "$2" ] && grep -c "plan finished" /root/log_${2%.sh}.log 2>/dev/null)
  bash carry/session/collect.sh
  [ "${finished:-0}" -gt 0 ] && break
done
cd /root/w && for f in logs/*.log; do echo "== $f"; tail -c 600 $f; echo; done
nvidia-smi --query-gpu=index,utilization.gpu,memory.used --format=csv
