#!/bin/bash
# Let the runs go on for $1 seconds (collecting), then SIGTERM them: each writes latest.pt and exits; collect last.
end=$(( $(date +%s) + $1 ))
[ -d /root/w ] || { echo "no /root/w: a fresh machine (the last one went back); nothing to stop. Put the ensure.sh lines before stop_all.sh"; exit 1; }
[ -f /root/call.started ] && mv /root/call.started /root/call.previous; touch /root/call.started  # collect.sh
while [ $(date +%s) -lt $end ]; do sleep 30; bash carry/session/collect.sh; done
pkill -TERM -f flexloop_gcdqn.py
for i in $(seq 60); do pgrep -f flexloop_gcdqn.py > /dev/null || break; sleep 1; done
echo "stopped after $i s"; bash carry/session/collect.sh
cd /root/w && for f in logs/*.log; do echo "== $f"; tail -c 800 $f; echo; done
