#!/bin/bash
# This session's plans, one ensure.sh line each. Put it before watch.sh or stop_all.sh in every call: on a warm
# machine it starts nothing (ensure.sh runs a plan once per machine), and on a fresh one (the last went back
# between calls) it starts the plans again from what carry/ holds, so no call only watches an empty machine.
# The 30th and 31st sessions' lease is one H200: plan_one_gpu.sh runs Generalize-4-2's end (skipped once its
# final.pt is carried), then the frozen-size wall clock of Exact-4 seeds 1-3, Exact-3 and Generalize-4-1 seed 2,
# one after another.
bash carry/session/ensure.sh plan_one_gpu
