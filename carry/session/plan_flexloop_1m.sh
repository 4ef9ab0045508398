#!/bin/bash
# FlexLoop to the paper's 1M post-training updates: 800k more from each 200k lambda-1 continuation's final.pt
# (carry/*-v0__ref-lambda1__*; --init-checkpoint, so the weights and the temperature go on while the optimiser, the
# target network and the replay start afresh, as they did at the continuation's start), one run per GPU, then
# eval_adaptive.py on its 200k and 1M checkpoints. RUNS lists ENV:SEED, the i-th on GPU FIRST_GPU + i (0 unless
# set; 4 GPUs: all four runs; the 14th session had 2 GPUs and set RUNS="BoxPick-Exact-4:1 BoxPick-Exact-4:2").
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
source carry/session/per_gpu.sh
TRAIN_FLAGS=${TRAIN_FLAGS:---require-cuda}  # a CPU dry run of the plan passes small-run flags in these two
EVAL_FLAGS=${EVAL_FLAGS:-}
EPOCHS=${EPOCHS:-8}                         # 8 x 100 intervals x 1,000 updates
RUNS=${RUNS:-BoxPick-Exact-3:1 BoxPick-Exact-4:1 BoxPick-Exact-4:2 BoxPick-Exact-4:3}
mkdir -p runs logs results
extend_and_evaluate() {  # gpu env seed
  local gpu=$1 env=$2 seed=$3
  local tag=$(run_tag $env $seed)   # e.g. exact4_ref_s1
  local start=$(ls carry/$env-v0__ref-lambda1__${seed}__*/final.pt)
  CUDA_VISIBLE_DEVICES=$gpu python3 flexloop_gcdqn.py --env-id $env-v0 --init-checkpoint $start --seed $seed \
    --num-epochs $EPOCHS --lambda-depth 1 $TRAIN_FLAGS --save-every-minutes 2 --exp-name ref-lambda1-to1m \
    > logs/${tag}_to1m.log 2>&1 || return
  CUDA_VISIBLE_DEVICES=$gpu python3 eval_adaptive.py --checkpoints $start \
    runs/$env-v0__ref-lambda1-to1m__${seed}__*/final.pt --labels FlexLoop-200k FlexLoop-1M $EVAL_FLAGS \
    --exp-name ${tag}_to1m --out-dir results/${tag}_to1m > logs/${tag}_to1m_eval.log 2>&1
}
on_each_gpu extend_and_evaluate
