#!/bin/bash
# Once per machine and plan: install the carried wheels, copy the tree to /root/w (first plan only) and start the
# plan there in its own process session, so that it outlives the call. A second plan can follow the first, and so
# can the same plan for another EXP (e.g. plan_resume_ref for ref, then for gen-flax on a machine still warm).
plan=${1%.sh}   # a plan_*.sh of carry/session, named with or without .sh
key=$plan${EXP:+_$EXP}   # what "already started" means: this plan for this EXP
if [ ! -f /tmp/site/.ok ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && touch /tmp/site/.ok || exit 1
fi
if [ ! -f /root/started_$key ]; then
  [ -f /root/plan.started ] || touch /root/plan.started   # the first plan's start: collect.sh compares with it
  touch /root/started_$key
  [ -d /root/w ] || { mkdir -p /root/w && tar --exclude=./.git -cf - . | (cd /root/w && tar xf -); }
  cp -rnp carry/. /root/w/carry/  # a later plan of the lease: the carry/ folders this call brought that it lacks
  (cd /root/w && PYTHONPATH=/tmp/site setsid nohup bash carry/session/$plan.sh > /root/log_$key.log 2>&1 < /dev/null &)
  echo "plan $key started $(date)"
else
  echo "plan $key already started at $(stat -c %y /root/started_$key)"
fi
nvidia-smi --query-gpu=index,name,utilization.gpu,memory.used --format=csv
