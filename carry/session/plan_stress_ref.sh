#!/bin/bash
# The paper's Table 3 for reference runs that ended in an earlier lease, whose stress test has not run (or was
# stopped): per_gpu.sh's stress_test on their carried pretrained.pt and final.pt, one run after another on GPU
# (0 unless set), so that no two timings share a GPU. RUNS lists ENV:SEED (by default every carried run of EXP,
# ref unless set, with a final.pt), or ENV:SEED:EPS:SPLIT for one split (e.g. BoxPick-Exact-4:2::unseen, when the
# other was timed in a lease that went back); STRESS_EPS is FlexLoop's calibrated eps (0.02, every Exact-4 seed's, unless set).
# UNFROZEN_TOO=1 times each run a second time with --no-stress-freeze-sizes (new bucket sizes captured inside timed
# blocks, the protocol before 2026-11-28), into results/<tag>_5m_unfrozen_stress_<split>, right after its first
# timing: an A/B on one card in one call.
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
source carry/session/per_gpu.sh
EVAL_FLAGS=${EVAL_FLAGS:-}
EXP=${EXP:-ref} GPU=${GPU:-0} STRESS_EPS=${STRESS_EPS:-0.02}
RUNS=${RUNS:-$(carried_runs $EXP 1)}
mkdir -p logs results
for run in $RUNS; do
  IFS=: read env seed eps split <<< "$run"
  eps=${eps:-$STRESS_EPS}
  export STRESS_SPLITS=${split:-train unseen}
  dir=$(ls -d carry/$env-v0__${EXP}__${seed}__*)
  stress_test $GPU $dir $(run_tag $env $seed $EXP)_5m $eps
  [ "$UNFROZEN_TOO" = 1 ] && STRESS_FLAGS="${STRESS_FLAGS:---stress-envs 32768} --no-stress-freeze-sizes" \
    stress_test $GPU $dir $(run_tag $env $seed $EXP)_5m_unfrozen $eps
done
echo "plan finished $(date)"
