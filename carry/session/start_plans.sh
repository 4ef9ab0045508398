#!/bin/bash
# This session's plans, one ensure.sh line each. Put it before watch.sh or stop_all.sh in every call: on a warm
# machine it starts nothing (ensure.sh runs a plan once per machine), and on a fresh one (the last went back
# between calls) it starts the plans again from what carry/ holds, so no call only watches an empty machine.
# The next leases (one H200 each): Exact-3's second seed under the paper's protocol. The first lease starts it
# (plan_start_ref); once its latest.pt and metrics.jsonl are in carry/BoxPick-Exact-3-v0__ref__2__<time>/, the
# next ones resume it (plan_resume_ref), which evaluates and times it when it ends. A machine that has started the
# run keeps it: carrying its latest.pt back mid-lease starts nothing more. The 32nd session changed GC-DQN's acting
# (policy_logits, now a network method, compiled) and evaluation (reseeded per depth) after its lease, so the next
# lease runs the GPU-only tests before it resumes (logs/gpu_tests.log, in progress.tgz).
if [ -f /root/started_plan_start_ref ] || ! ls carry/BoxPick-Exact-3-v0__ref__2__*/latest.pt > /dev/null 2>&1; then
  RUNS=BoxPick-Exact-3:2 bash carry/session/ensure.sh plan_start_ref
else
  RUNS=BoxPick-Exact-3:2 bash carry/session/ensure.sh plan_resume_ref   # the GPU-only tests first (84 s)
fi
