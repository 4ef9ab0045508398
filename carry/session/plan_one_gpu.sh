#!/bin/bash
# A lease of one GPU (the 30th session's): the plans that would share two GPUs, one after another on GPU 0, so that
# no Table 3 timing shares its GPU with training or with another timing.
#   1. Generalize-4-2's last FlexLoop updates (from 5,940,033), then its evaluation and wall clock (plan_resume_ref)
#   2. Table 3's wall clock with the bucket sizes frozen after the warm-up (eval_adaptive.py's default since
#      74389dc), as Generalize-4-1 seeds 1 and 3 were: Exact-4 seeds 1-3 (eps* 0.02), Exact-3 (0.03), then
#      Generalize-4-1 seed 2 (0.03, its evaluation's calibrated eps for FlexLoop)
mkdir -p logs
EXP=gen-flax SKIP_GPU_TESTS=1 RUNS=BoxPick-Generalize-4-2:1 bash carry/session/plan_resume_ref.sh > logs/plan_resume_gen_flax.log 2>&1
GPU=0 RUNS="BoxPick-Exact-4:1 BoxPick-Exact-4:2 BoxPick-Exact-4:3 BoxPick-Exact-3:1:0.03" \
  bash carry/session/plan_stress_ref.sh > logs/plan_stress_ref.log 2>&1
EXP=gen-flax GPU=0 STRESS_EPS=0.03 RUNS=BoxPick-Generalize-4-1:2 bash carry/session/plan_stress_ref.sh \
  > logs/plan_stress_gen_flax.log 2>&1
echo "plan finished $(date)"
