#!/bin/bash
# The control of the 1M FlexLoop runs: Self-TD Only (lambda 0, the RL loss alone) for the same 1M updates from the
# IRU-5 checkpoint FlexLoop started from, one run per GPU, then eval_adaptive.py on it with the episodes of the 13th
# session's evaluation (same --seed and envs), so its results.json joins that seed's others in bench/seed_table.py.
# START_DIR, START and START_FILE name the starting checkpoint, <START_DIR>/<ENV>-v0__<START>__<SEED>*/<START_FILE>
# (START_DIR carry unless set; plan_resume_ref passes runs, where a run wrote its pretrained.pt); by default the
# 200k-update IRU-5 checkpoints, which are in git history only; before the calls, here:
#   for s in 1 2; do d=carry/BoxPick-Exact-4-v0__ref-start__${s}; mkdir -p $d
#     git show b334973:carry/BoxPick-Exact-4-v0__ref__${s}__1795763631/latest.pt > $d/latest.pt; done
# The control of a reference run's own FlexLoop phase (5M + 1M) starts from its pretrained.pt instead:
#   START=ref START_FILE=pretrained.pt EXP=ref-5m-lambda0-1m LABEL=Self-TD-Only-5M+1M
# RUNS lists ENV:SEED, the i-th on GPU FIRST_GPU + i (0 unless set). A control an earlier lease stopped, its latest.pt
# carried back into carry/<ENV>-v0__<EXP>__<SEED>__*/ (and no final.pt there), resumes from it instead.
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
source carry/session/per_gpu.sh
TRAIN_FLAGS=${TRAIN_FLAGS:---require-cuda}  # a CPU dry run of the plan passes small-run flags in these two
EVAL_FLAGS=${EVAL_FLAGS:-}
EPOCHS=${EPOCHS:-10}                        # 10 x 100 intervals x 1,000 updates: FlexLoop's 200k + 800k
RUNS=${RUNS:-BoxPick-Exact-4:1 BoxPick-Exact-4:2}
START_DIR=${START_DIR:-carry} START=${START:-ref-start} START_FILE=${START_FILE:-latest.pt}
EXP=${EXP:-ref-lambda0-1m} LABEL=${LABEL:-Self-TD-Only-1M}
mkdir -p runs logs results
train_and_evaluate() {  # gpu env seed
  local gpu=$1 env=$2 seed=$3
  local base=${START%-start}   # the exp-name of the run it starts from: ref, or gen-flax
  local tag=$(run_tag $env $seed $base)_$(echo ${EXP#$base-} | tr - _)   # e.g. exact4_ref_s1_lambda0_1m
  local stopped=$(ls -d carry/$env-v0__${EXP}__${seed}__* 2>/dev/null | head -1)
  if [ -n "$stopped" ] && [ -f $stopped/latest.pt ] && [ ! -f $stopped/final.pt ]; then
    local run=runs/$(basename $stopped)
    cp -rp $stopped runs/ && chmod -R u+w $run   # -p: collect.sh reads the times
    CUDA_VISIBLE_DEVICES=$gpu python3 flexloop_gcdqn.py --resume $run/latest.pt $TRAIN_FLAGS --save-every-minutes 2 \
      >> logs/$tag.log 2>&1 || return
  else
    local start=$(ls $START_DIR/$env-v0__${START}__$seed*/$START_FILE 2>/dev/null | head -1)
    [ -n "$start" ] || { echo "no $START_DIR/$env-v0__${START}__$seed*/$START_FILE to start from" > logs/$tag.log; return; }
    CUDA_VISIBLE_DEVICES=$gpu python3 flexloop_gcdqn.py --env-id $env-v0 --init-checkpoint $start \
      --seed $seed --num-epochs $EPOCHS --lambda-depth 0 $TRAIN_FLAGS --save-every-minutes 2 --exp-name $EXP \
      > logs/$tag.log 2>&1 || return
  fi
  ls runs/$env-v0__${EXP}__${seed}__*/final.pt > /dev/null 2>&1 || return   # stopped (SIGTERM): latest.pt, to resume
  CUDA_VISIBLE_DEVICES=$gpu python3 eval_adaptive.py --checkpoints runs/$env-v0__${EXP}__${seed}__*/final.pt \
    --labels $LABEL $EVAL_FLAGS --exp-name $tag --out-dir results/$tag > logs/${tag}_eval.log 2>&1
}
on_each_gpu train_and_evaluate
