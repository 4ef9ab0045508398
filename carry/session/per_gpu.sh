# Sourced by the plan_*.sh scripts: what they share.
# run_tag ENV SEED [EXP]: the short name of a run's logs and results, e.g. BoxPick-Exact-4 1 -> exact4_ref_s1
# (EXP ref unless given; BoxPick-Generalize-4-1 1 gen-flax -> generalize41_gen_flax_s1)
run_tag() { echo $(echo ${1#BoxPick-} | tr -d - | tr A-Z a-z)_$(echo ${3:-ref} | tr - _)_s$2; }
# carried_runs EXP ENDED: the ENV:SEED of each carry/ run of exp-name EXP that has ended (ENDED=1: a final.pt) or is
# still going (ENDED=0: a latest.pt and no final.pt), e.g. BoxPick-Exact-4:1
carried_runs() {
  local d
  for d in carry/*-v0__$1__*; do
    if [ $2 = 1 ]; then [ -f $d/final.pt ]; else [ -f $d/latest.pt ] && [ ! -f $d/final.pt ]; fi && basename $d
  done | sed -E "s/-v0__$1__([0-9]+)__.*/:\1/"
}
# on_each_gpu FUNCTION: FUNCTION GPU ENV SEED for each ENV:SEED in $RUNS, the i-th on GPU FIRST_GPU + i (0 unless
# set; FIRST_GPU=2 puts a second plan of a 4-GPU machine on GPUs 2, 3), all at once; then waits for them all.
on_each_gpu() {
  local gpu=${FIRST_GPU:-0} run
  for run in $RUNS; do
    $1 $gpu ${run%:*} ${run#*:} &
    gpu=$((gpu + 1))
  done
  wait
  echo "plan finished $(date)"
}
# stress_test GPU DIR TAG EPS: the paper's Table 3, the wall clock of DIR's pretrained.pt (IRU-5 at 5M) and final.pt
# (FlexLoop, 5M + 1M) at 32,768 envs ($STRESS_FLAGS) and FlexLoop's calibrated EPS, each split in a run of its own
# (so that a failure cannot cost the other), into results/TAG_stress_<split>; STRESS_SPLITS picks the splits
stress_test() {
  local gpu=$1 dir=$2 tag=$3 eps=$4 split
  for split in ${STRESS_SPLITS:-train unseen}; do
    CUDA_VISIBLE_DEVICES=$gpu python3 eval_adaptive.py --checkpoints $dir/pretrained.pt $dir/final.pt \
      --labels IRU-5-5M FlexLoop-5M+1M --skip-eval ${STRESS_FLAGS:---stress-envs 32768} --stress-eps $eps \
      --stress-split $split $EVAL_FLAGS --exp-name ${tag}_stress_$split --out-dir results/${tag}_stress_$split \
      > logs/${tag}_stress_$split.log 2>&1
  done
}
