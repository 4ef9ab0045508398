"""How often the stress test's compact mode meets bucket sizes it has not captured yet, replayed eagerly (CPU is fine).

    python bench/bucket_sizes.py --checkpoint checkpoints/BoxPick-Generalize-4-1-v0__gen-flax__1__*/final.pt --split train
    python bench/bucket_sizes.py --checkpoint ... --split train --freeze      # as --stress-freeze-sizes

On a GPU, compact mode (eval_adaptive.py --stress-envs, CUDA graphs) captures one policy graph per set of bucket
sizes, and a capture inside a timed block slows that block. The bucket logic does not depend on the device, so
this runs it eagerly (bucketed, no graphs) and prints JSON: the new sizes met in the warm-up and in each 100 steps
after it, the overflow redos, and the mean bucket size as a fraction of the envs (the compute the buckets keep),
overall and as quartiles over the timed blocks of 10 steps: a wide spread there is work that changes from block
to block (the episodes' phase), which no capture policy removes. rows_run_over_exact is the work the sizes cost:
rows advanced one recurrent step (redos included) over what exact compaction advances. rows_at_depth_K_min and
steps_with_a_row_at_depth_K say how often some row of the batch needs the last depth: in those steps the batch as
a whole runs all K depths, so only fewer rows per depth (compact mode), never fewer depths, can shorten them.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import eval_adaptive  # noqa: E402
import flexloop_run  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--checkpoint", required=True)
parser.add_argument("--split", choices=("train", "unseen"), default="unseen")
parser.add_argument("--eps", type=float, default=0.05)
parser.add_argument("--num-envs", type=int, default=4096)
parser.add_argument("--warmup", type=int, default=100, help="as eval_adaptive.py --stress-warmup")
parser.add_argument("--steps", type=int, default=500, help="the steps a stress test times (50 samples of 10)")
parser.add_argument("--freeze", action="store_true", help="no new sizes after the warm-up, as eval_adaptive.py by default "
                    "(without it: as --no-stress-freeze-sizes)")
parser.add_argument("--margin", type=float, default=0.05, help="as eval_adaptive.py --stress-bucket-margin")
parser.add_argument("--window", type=int, default=10, help="as eval_adaptive.py --stress-bucket-window")
parser.add_argument("--min-shrink", type=float, default=0.1, help="as eval_adaptive.py --stress-min-shrink")
parser.add_argument("--seed", type=int, default=1)
args = parser.parse_args()

module, checkpoint = flexloop_run.load_any_checkpoint(args.checkpoint)
network, _ = module.network_from_checkpoint(checkpoint, torch.device("cpu"))
network.eval().requires_grad_(False)
stepper = eval_adaptive.StressStepper(network, "compact", args.eps, 1, args.num_envs, checkpoint["env_id"], args.split,
                                      args.seed, torch.device("cpu"), use_graph=False, bucketed=True,
                                      margin=args.margin, window=args.window, min_shrink=args.min_shrink)
start = time.time()
new_sizes, bucket_fraction, rows_at_depth_K = [], [], []
with torch.no_grad():
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            stepper.rows_run, stepper.rows_needed = 0, 0
            if args.freeze:
                stepper.freeze()
        captured, sizes = stepper.captured_policies(), stepper.sizes
        stepper.step()
        new_sizes.append(stepper.captured_policies() - captured)
        bucket_fraction.append(sum(sizes) / (args.num_envs * max(stepper.num_levels, 1)))
        rows_at_depth_K.append(int((stepper.depth == network.depth).sum()))
timed = new_sizes[args.warmup:]
block_fractions = sorted(sum(bucket_fraction[i:i + 10]) / 10 for i in range(args.warmup, args.warmup + args.steps, 10))
print(json.dumps({
    "checkpoint": args.checkpoint, "env_id": checkpoint["env_id"], "split": args.split, "eps": args.eps,
    "num_envs": args.num_envs, "freeze": args.freeze, "margin": args.margin, "window": args.window,
    "min_shrink": args.min_shrink,
    "new_sizes_in_warmup": sum(new_sizes[:args.warmup]), "new_sizes_after_warmup": sum(timed),
    "new_sizes_per_100_steps": [sum(timed[i:i + 100]) for i in range(0, len(timed), 100)],
    "overflow_steps": stepper.overflow_steps,
    "mean_bucket_fraction_after_warmup": sum(bucket_fraction[args.warmup:]) / args.steps,
    "block_bucket_fraction_q25_median_q75": [block_fractions[int(q * (len(block_fractions) - 1))] for q in (0.25, 0.5, 0.75)],
    "rows_run_over_exact": stepper.report()["rows_run_over_exact"],
    "mean_depth": stepper.report()["mean_depth"],
    "rows_at_depth_K_min": min(rows_at_depth_K[args.warmup:]),
    "steps_with_a_row_at_depth_K": sum(n > 0 for n in rows_at_depth_K[args.warmup:]) / args.steps,
    "seconds": round(time.time() - start, 1)}))
