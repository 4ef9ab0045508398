#!/bin/bash
# Once per machine: install the carried wheels, copy the tree to /root/w and start the plan there in its own session.
if [ ! -f /tmp/site/.ok ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && touch /tmp/site/.ok || exit 1
fi
if [ ! -f /root/plan.started ]; then
  touch /root/plan.started
  mkdir -p /root/w && tar --exclude=./.git -cf - . | (cd /root/w && tar xf -)
  (cd /root/w && PYTHONPATH=/tmp/site setsid nohup bash carry/session/$1 > /root/plan.log 2>&1 < /dev/null &)
  echo "plan $1 started $(date)"
else
  echo "plan already running since $(stat -c %y /root/plan.started)"
fi
nvidia-smi --query-gpu=index,name,utilization.gpu,memory.used --format=csv
