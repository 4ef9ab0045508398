#!/bin/bash
# Run here, not on the device. What travels holds 64 MiB, and four runs' latest.pt (9 MiB each) with three
# pretrained.pt in full would pass it. What the device reads of a pretrained.pt is its model alone (eval_adaptive.py's
# network_from_checkpoint; --init-checkpoint for the Self-TD Only control), so before the calls swap each carried
# pretrained.pt of EXP (gen-flax unless set) for a copy without its target network and optimizer (2.3 of 9 MiB);
# the full files wait in HELD (/work/held_pretrained unless set). FILE=final.pt does the same to the final.pt of
# runs that ended, for a plan that only times or evaluates them (plan_stress_ref).
#   bash carry/session/slim_pretrained.sh          # before the first call
#   bash carry/session/slim_pretrained.sh restore  # after the last: the full files back (git status then clean)
cd "$(git rev-parse --show-toplevel)"
EXP=${EXP:-gen-flax}
FILE=${FILE:-pretrained.pt}
HELD=${HELD:-/work/held_pretrained}
PYTHON=${PYTHON:-.venv/bin/python}
if [ "$1" = restore ]; then
  for f in $HELD/*/*.pt; do [ -f "$f" ] && mv "$f" "carry/$(basename "$(dirname "$f")")/"; done
  rm -rf "$HELD"
  exit
fi
for f in carry/*-v0__${EXP}__*/$FILE; do
  [ -f "$f" ] || continue
  run=$(basename "$(dirname "$f")")
  [ -f "$HELD/$run/$FILE" ] && { echo "$HELD/$run/$FILE exists: restore first"; exit 1; }
  mkdir -p "$HELD/$run" && mv "$f" "$HELD/$run/$FILE"
  $PYTHON - "$HELD/$run/$FILE" "$f" <<'EOF' || exit 1
import sys, torch
full = torch.load(sys.argv[1], map_location="cpu", weights_only=True)
torch.save({k: v for k, v in full.items() if k not in ("target_model", "optimizer")}, sys.argv[2])
EOF
  echo "$f: $(stat -c %s "$f") bytes (full: $HELD/$run/$FILE)"
done
