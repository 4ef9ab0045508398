#!/bin/bash
# Keep the call alive for $1 seconds, collecting every minute; print each run's last log line.
end=$(( $(date +%s) + $1 ))
while [ $(date +%s) -lt $end ]; do sleep 60; bash carry/session/collect.sh; done
cd /root/w && for f in logs/*.log; do echo "== $f"; tail -c 600 $f; echo; done
nvidia-smi --query-gpu=index,utilization.gpu,memory.used --format=csv
