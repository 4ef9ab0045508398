#!/bin/bash
# Resume the reference-defaults BoxPick runs of exp-name EXP (ref unless set; the Generalize runs are gen-flax), one
# per GPU: RUNS lists ENV:SEED, the i-th on GPU FIRST_GPU + i (0 unless set; by default every run still going; two
# runs sharing a GPU make fewer updates together than one alone, BENCHMARKS.md, so on 2 GPUs list two). GPU 0
# first runs the GPU-only tests (SKIP_GPU_TESTS=1: not, e.g. when the training code has not changed since they last
# passed). A run that ends (5M pretraining updates, then its own 1M of FlexLoop) is then evaluated, the paper's
# whole protocol: eval_adaptive.py on its pretrained.pt (IRU-5 at 5M) and final.pt. Then the paper's Table 3: the
# wall clock of both at 32,768 envs on each split, at the ε that evaluation calibrated for FlexLoop (a run of its
# own, so that a failure cannot cost the above). With CONTROL=1 the run's GPU then trains its control, Self-TD Only
# for 1M updates from the same pretrained.pt (plan_selftd_1m.sh, evaluated on the same episodes).
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
source carry/session/per_gpu.sh
TRAIN_FLAGS=${TRAIN_FLAGS:---require-cuda}  # a CPU dry run of the plan passes --no-cuda in these two
EVAL_FLAGS=${EVAL_FLAGS:-}
# STRESS_FLAGS (per_gpu.sh's stress_test; --stress-envs 32768 unless set): a CPU dry run passes e.g.
# --stress-envs 64 --stress-samples 5
EXP=${EXP:-ref}
# by default every carried run of EXP still going: a latest.pt and no final.pt (e.g. BoxPick-Exact-4:1)
RUNS=${RUNS:-$(carried_runs $EXP 0)}
mkdir -p runs logs results && cp -rp carry/*-v0__${EXP}__* runs/ && chmod -R u+w runs   # -p: collect.sh reads the times
resume_and_evaluate() {  # gpu env seed
  local gpu=$1 env=$2 seed=$3
  local d=$(ls -d runs/$env-v0__${EXP}__${seed}__*)
  local tag=$(run_tag $env $seed $EXP)   # e.g. exact4_ref_s1
  if [ $gpu = 0 ] && [ -z "$SKIP_GPU_TESTS" ] && [ ! -f logs/gpu_tests.log ]; then
    CUDA_VISIBLE_DEVICES=0 python3 -m pytest tests -q -rs -k "cuda or captured or compiled or bf16" > logs/gpu_tests.log 2>&1
  fi
  CUDA_VISIBLE_DEVICES=$gpu python3 flexloop_gcdqn.py --resume $d/latest.pt $TRAIN_FLAGS --save-every-minutes 2 \
    > logs/$tag.log 2>&1 || return   # stopped (SIGTERM): latest.pt, to resume next lease
  [ -f $d/final.pt ] || return
  CUDA_VISIBLE_DEVICES=$gpu python3 eval_adaptive.py --checkpoints $d/pretrained.pt $d/final.pt \
    --labels IRU-5-5M FlexLoop-5M+1M $EVAL_FLAGS --exp-name ${tag}_5m --out-dir results/${tag}_5m \
    > logs/${tag}_5m_eval.log 2>&1 || return
  local eps=$(python3 -c "import json, sys; print(json.load(open(sys.argv[1]))['checkpoints'][1]['calibration']['eps'])" \
    results/${tag}_5m/results.json)
  stress_test $gpu $d ${tag}_5m $eps
  [ -n "$CONTROL" ] && START_DIR=runs START=$EXP START_FILE=pretrained.pt EXP=$EXP-5m-lambda0-1m LABEL=Self-TD-Only-5M+1M \
    RUNS=$env:$seed FIRST_GPU=$gpu bash carry/session/plan_selftd_1m.sh > logs/${tag}_5m_control_plan.log 2>&1
}
on_each_gpu resume_and_evaluate
