#!/bin/bash
# This session's plans, one ensure.sh line each. Put it before watch.sh or stop_all.sh in every call: on a warm
# machine it starts nothing (ensure.sh runs a plan once per machine), and on a fresh one (the last went back
# between calls) it starts the plans again from what carry/ holds, so no call only watches an empty machine.
#   GPU 0, 1: the Generalize runs still going (4-1 seed 2, then its evaluation and wall clock; 4-2)
#   GPU 2:    Table 3's wall clock of 4-1 seeds 1 and 3 at their eps* (0.05), both splits, each also with
#             --stress-freeze-sizes (FREEZE_TOO=1) right after
#   GPU 3:    4-1 seed 1's control (the RL loss alone from its pretrained.pt), resumed from its latest.pt
EXP=gen-flax SKIP_GPU_TESTS=1 bash carry/session/ensure.sh plan_resume_ref
EXP=gen-flax GPU=2 STRESS_EPS=0.05 FREEZE_TOO=1 RUNS="BoxPick-Generalize-4-1:1 BoxPick-Generalize-4-1:3" \
  bash carry/session/ensure.sh plan_stress_ref
START=gen-flax START_FILE=pretrained.pt EXP=gen-flax-5m-lambda0-1m LABEL=Self-TD-Only-5M+1M \
  RUNS=BoxPick-Generalize-4-1:1 FIRST_GPU=3 bash carry/session/ensure.sh plan_selftd_1m
