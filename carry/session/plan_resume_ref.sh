#!/bin/bash
# Resume the reference-defaults BoxPick runs, one per GPU; GPU 0 first runs the GPU-only tests (SKIP_GPU_TESTS=1:
# not, e.g. when the code has not changed since they last passed).
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
mkdir -p runs logs && cp -rp carry/*-v0__ref__* runs/ && chmod -R u+w runs   # -p: collect.sh reads the times
for s in 1 2 3; do
  d=$(ls -d runs/BoxPick-Exact-4-v0__ref__${s}__*)
  CUDA_VISIBLE_DEVICES=$s python3 flexloop_gcdqn.py --resume $d/latest.pt --require-cuda --save-every-minutes 2 > logs/exact4_ref_s$s.log 2>&1 &
done
(
  [ -f logs/gpu_tests.log ] || [ -n "$SKIP_GPU_TESTS" ] || CUDA_VISIBLE_DEVICES=0 python3 -m pytest tests -q -rs -k "cuda or captured or compiled or bf16" > logs/gpu_tests.log 2>&1
  d=$(ls -d runs/BoxPick-Exact-3-v0__ref__1__*)
  CUDA_VISIBLE_DEVICES=0 python3 flexloop_gcdqn.py --resume $d/latest.pt --require-cuda --save-every-minutes 2 > logs/exact3_ref_s1.log 2>&1
) &
wait
echo "plan finished $(date)"
