# Sourced by the plan_*.sh scripts: what they share.
# run_tag ENV SEED [EXP]: the short name of a run's logs and results, e.g. BoxPick-Exact-4 1 -> exact4_ref_s1
# (EXP ref unless given; BoxPick-Generalize-4-1 1 gen-flax -> generalize41_gen_flax_s1)
run_tag() { echo $(echo ${1#BoxPick-} | tr -d - | tr A-Z a-z)_$(echo ${3:-ref} | tr - _)_s$2; }
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
