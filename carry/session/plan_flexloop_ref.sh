#!/bin/bash
# FlexLoop (lambda 1) and Self-TD Only (lambda 0) for 200k updates from each reference-defaults run's carried
# latest.pt, the two of a run sharing its GPU, then eval_adaptive.py on the three checkpoints (README: "FlexLoop and
# Self-TD Only from each seed's 1M checkpoint", the same protocol). GPU 0: Exact-3 seed 1; GPUs 1-3: Exact-4 seeds 1-3.
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
TRAIN_FLAGS=${TRAIN_FLAGS:---require-cuda}  # a CPU dry run of the plan passes small-run flags in these two
EVAL_FLAGS=${EVAL_FLAGS:-}
mkdir -p runs logs results && cp -rp carry/*-v0__ref__* runs/ && chmod -R u+w runs
continue_and_evaluate() {  # gpu env seed tag
  local gpu=$1 env=$2 seed=$3 tag=$4
  local base=$(ls -d runs/$env-v0__ref__${seed}__*)/latest.pt
  for lam in 1 0; do
    CUDA_VISIBLE_DEVICES=$gpu python3 flexloop_gcdqn.py --env-id $env-v0 --init-checkpoint $base --seed $seed \
      --num-epochs 2 --lambda-depth $lam $TRAIN_FLAGS --exp-name ref-lambda$lam > logs/${tag}_lambda$lam.log 2>&1 &
  done
  wait
  CUDA_VISIBLE_DEVICES=$gpu python3 eval_adaptive.py --checkpoints $base \
    runs/$env-v0__ref-lambda0__${seed}__*/final.pt runs/$env-v0__ref-lambda1__${seed}__*/final.pt \
    --labels IRU-5 Self-TD-Only FlexLoop $EVAL_FLAGS --exp-name ${tag} --out-dir results/$tag > logs/${tag}_eval.log 2>&1
}
(  # GPU 0 first runs the GPU-only tests and the collection benchmark (BENCHMARKS.md, "the collection's policy
   # compiled"); a CPU dry run has no nvidia-smi and skips them
  if nvidia-smi > /dev/null 2>&1; then
    CUDA_VISIBLE_DEVICES=0 python3 -m pytest tests -q -rs -k "cuda or captured or compiled or bf16" > logs/gpu_tests.log 2>&1
    CUDA_VISIBLE_DEVICES=0 python3 bench/train_throughput.py --paths > logs/bench_collection.log 2>&1
  fi
  continue_and_evaluate 0 BoxPick-Exact-3 1 exact3_ref_s1
) &
for s in 1 2 3; do continue_and_evaluate $s BoxPick-Exact-4 $s exact4_ref_s$s & done
wait
echo "plan finished $(date)"
