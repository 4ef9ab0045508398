#!/bin/bash
# Resume the reference-defaults BoxPick runs, one per GPU: RUNS lists ENV:SEED, the i-th on GPU i (all four by
# default, for 4 GPUs; two runs sharing a GPU make fewer updates together than one alone, BENCHMARKS.md, so on 2
# GPUs list two). GPU 0 first runs the GPU-only tests (SKIP_GPU_TESTS=1: not, e.g. when the training code has not
# changed since they last passed).
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
RUNS=${RUNS:-BoxPick-Exact-3:1 BoxPick-Exact-4:1 BoxPick-Exact-4:2 BoxPick-Exact-4:3}
mkdir -p runs logs && cp -rp carry/*-v0__ref__* runs/ && chmod -R u+w runs   # -p: collect.sh reads the times
resume() {  # gpu env seed
  local d=$(ls -d runs/$2-v0__ref__${3}__*)
  local log=logs/$(echo ${2#BoxPick-} | tr -d - | tr A-Z a-z)_ref_s$3.log   # e.g. logs/exact4_ref_s1.log
  if [ $1 = 0 ] && [ -z "$SKIP_GPU_TESTS" ] && [ ! -f logs/gpu_tests.log ]; then
    CUDA_VISIBLE_DEVICES=0 python3 -m pytest tests -q -rs -k "cuda or captured or compiled or bf16" > logs/gpu_tests.log 2>&1
  fi
  CUDA_VISIBLE_DEVICES=$1 python3 flexloop_gcdqn.py --resume $d/latest.pt --require-cuda --save-every-minutes 2 > $log 2>&1
}
gpu=0
for run in $RUNS; do
  resume $gpu ${run%:*} ${run#*:} &
  gpu=$((gpu + 1))
done
wait
echo "plan finished $(date)"
