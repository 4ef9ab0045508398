#!/usr/bin/env bash
# Screen the authors' PPO choices on LightsOut-4x5 (docs/reference.md): IRU-5 GC-PPO pretraining at the reference budget
# (50M env steps), 3 seeds per variant, every run of the call in the background on one GPU. Each variant switches
# one choice of CleanRL's to the authors'; "reference" switches the authors' four batch choices at once.
#
#   bash sweeps/lightsout_screen.sh GPU VARIANT...        e.g.  bash sweeps/lightsout_screen.sh 0 hard-reset
#   SEEDS="1 2" EVAL_EVERY=8 EXTRA="--track --wandb-group screen" bash sweeps/lightsout_screen.sh 1 reference
#
# Runs go to $RUN_DIR/LightsOut-4x5-v0__screen-<variant>__<seed>__<time>/ (metrics.jsonl, final.pt), their output to
# $RUN_DIR/screen-logs/<variant>__<seed>.log. The script waits for its runs, then prints each one's last evaluation
# (full-depth success on train and unseen tasks).
set -euo pipefail
cd "$(dirname "$0")/.."

# The screen ran against the defaults of its time, CleanRL's choices ("cleanrl"). Since then the defaults are the
# authors' hard resets, per-rollout advantages and time rows ("authors-neutral"; README, LightsOut screen), so
# every variant spells out those three flags: each reruns what ran.
declare -A VARIANT_FLAGS=(
  [defaults]=""
  [cleanrl]="--hard-reset-every 0 --advantage-norm minibatch --minibatch-layout rows"
  [hard-reset]="--hard-reset-every 3 --advantage-norm minibatch --minibatch-layout rows"
  [adv-rollout]="--hard-reset-every 0 --advantage-norm rollout --minibatch-layout rows"
  [time-rows]="--hard-reset-every 0 --advantage-norm minibatch --minibatch-layout time-rows"
  [norm-before]="--hard-reset-every 0 --advantage-norm minibatch --minibatch-layout rows --obs-norm-update before-epochs"
  [timeout-zero]="--hard-reset-every 0 --advantage-norm minibatch --minibatch-layout rows --timeout-bootstrap zero"
  [reference]="--hard-reset-every 3 --advantage-norm rollout --minibatch-layout time-rows --obs-norm-update before-epochs"
  [reference-timeout]="--hard-reset-every 3 --advantage-norm rollout --minibatch-layout time-rows --obs-norm-update before-epochs --timeout-bootstrap zero"
  # the authors' PPO loss: unclipped value loss, no gradient clipping
  [ref-loss]="--hard-reset-every 0 --advantage-norm minibatch --minibatch-layout rows --no-clip-vloss --max-grad-norm inf"
  # the authors' initialisation (flax defaults) and Adam epsilon
  [flax-init]="--hard-reset-every 0 --advantage-norm minibatch --minibatch-layout rows --init flax --adam-eps 1e-8"
  # the authors' choice wherever ours showed no gain in the first screen
  [candidate]="--hard-reset-every 3 --advantage-norm rollout --minibatch-layout time-rows --init flax --adam-eps 1e-8"
  # the authors' three choices that were neutral alone, with our loss and init: today's defaults
  [authors-neutral]="--hard-reset-every 3 --advantage-norm rollout --minibatch-layout time-rows"
)

if [ $# -lt 2 ]; then
  echo "usage: bash sweeps/lightsout_screen.sh GPU VARIANT...   variants: ${!VARIANT_FLAGS[*]}" >&2
  exit 2
fi
GPU=$1; shift
for variant in "$@"; do
  [ -n "${VARIANT_FLAGS[$variant]+set}" ] || { echo "unknown variant $variant; known: ${!VARIANT_FLAGS[*]}" >&2; exit 2; }
done

PYTHON=${PYTHON:-python}
SEEDS=${SEEDS:-"1 2 3"}
RUN_DIR=${RUN_DIR:-runs}
EVAL_EVERY=${EVAL_EVERY:-8}
EXTRA=${EXTRA:-}
mkdir -p "$RUN_DIR/screen-logs"

pids=()
for variant in "$@"; do
  for seed in $SEEDS; do
    # word splitting of the flag strings is wanted here
    # shellcheck disable=SC2086
    CUDA_VISIBLE_DEVICES=$GPU OMP_NUM_THREADS=1 "$PYTHON" iru_pretrain.py gcppo --require-cuda --seed "$seed" \
      --pretrain-timesteps 50000000 --eval-every "$EVAL_EVERY" --exp-name "screen-$variant" --run-dir "$RUN_DIR" \
      ${VARIANT_FLAGS[$variant]} $EXTRA > "$RUN_DIR/screen-logs/${variant}__${seed}.log" 2>&1 &
    pids+=($!)
    echo "started screen-$variant seed $seed on GPU $GPU (pid $!)"
  done
done

failed=0
for pid in "${pids[@]}"; do wait "$pid" || failed=$((failed + 1)); done
[ "$failed" -eq 0 ] || echo "$failed run(s) failed; see $RUN_DIR/screen-logs/" >&2

# each variant's newest run per seed: the last evaluation at full depth
"$PYTHON" - "$RUN_DIR" "$@" <<'EOF'
import glob, json, os, sys
run_dir, variants = sys.argv[1], sys.argv[2:]
for variant in variants:
    newest = {}
    for path in sorted(glob.glob(f"{run_dir}/LightsOut-4x5-v0__screen-{variant}__*/metrics.jsonl"), key=os.path.getmtime):
        newest[os.path.basename(os.path.dirname(path)).split("__")[2]] = path
    for seed, path in sorted(newest.items()):
        lines = [line for line in open(path) if line.endswith("\n")]  # a killed run may leave a cut last line
        evals = [r for r in map(json.loads, lines) if "eval/train/success_depth_5" in r]
        if evals:
            last = evals[-1]
            print(f"{variant:18s} seed {seed}  step {last['global_step']:>9d}  "
                  f"train {last['eval/train/success_depth_5']:.3f}  unseen {last['eval/unseen/success_depth_5']:.3f}")
EOF
exit "$failed"
