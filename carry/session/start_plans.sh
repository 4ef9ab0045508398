#!/bin/bash
# This session's plans, one ensure.sh line each. Put it before watch.sh or stop_all.sh in every call: on a warm
# machine it starts nothing (ensure.sh runs a plan once per machine), and on a fresh one (the last went back
# between calls) it starts the plans again from what carry/ holds, so no call only watches an empty machine.
#   GPU 0: Generalize-4-2's last FlexLoop updates, then its evaluation and wall clock (plan_resume_ref)
#   GPU 1: Table 3's wall clock of Exact-4 seeds 1-3 (eps* 0.02) and Exact-3 (0.03) again, now with the bucket
#          sizes frozen after the warm-up (eval_adaptive.py's default since 74389dc), as Generalize-4-1's were
EXP=gen-flax SKIP_GPU_TESTS=1 RUNS=BoxPick-Generalize-4-2:1 bash carry/session/ensure.sh plan_resume_ref
GPU=1 RUNS="BoxPick-Exact-4:1 BoxPick-Exact-4:2 BoxPick-Exact-4:3 BoxPick-Exact-3:1:0.03" \
  bash carry/session/ensure.sh plan_stress_ref
