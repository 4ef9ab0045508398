#!/bin/bash
# Start new BoxPick runs with today's defaults (the paper's protocol: 5M updates of IRU-5, then 1M of FlexLoop),
# exp-name EXP (ref unless set), one per GPU: RUNS lists ENV:SEED, the i-th on GPU FIRST_GPU + i (0 unless set),
# e.g. RUNS=BoxPick-Exact-3:2 for Exact-3's second seed. A run takes several leases: stop_all.sh stops it (SIGTERM
# writes latest.pt), collect.sh brings latest.pt back, and once it is in carry/<env>-v0__<EXP>__<seed>__<time>/ with
# its metrics.jsonl, plan_resume_ref.sh goes on from there, and evaluates and times the run when it ends.
# A run that carry/ already holds is refused here, so that a lease never starts it over by mistake.
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
source carry/session/per_gpu.sh
TRAIN_FLAGS=${TRAIN_FLAGS:---require-cuda}  # a CPU dry run passes --no-cuda and the small-run flags
EXP=${EXP:-ref}
mkdir -p logs runs
start_run() {  # gpu env seed
  local gpu=$1 env=$2 seed=$3
  if ls -d carry/$env-v0__${EXP}__${seed}__* > /dev/null 2>&1; then
    echo "carry/ already holds $env seed $seed ($EXP): resume it with plan_resume_ref.sh (RUNS=$env:$seed)"
    return 1
  fi
  CUDA_VISIBLE_DEVICES=$gpu python3 flexloop_gcdqn.py --env-id $env-v0 --seed $seed --exp-name $EXP $TRAIN_FLAGS \
    --save-every-minutes 2 > logs/$(run_tag $env $seed $EXP).log 2>&1
}
on_each_gpu start_run
