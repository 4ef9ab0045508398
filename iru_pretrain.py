"""Fixed-depth IRU-K pretraining (lambda_depth = 0, fresh weights) through any FlexLoop script.

    python iru_pretrain.py gcdqn --env-id BoxPick-Exact-4-v0 --depth 5
    python iru_pretrain.py gcppo --pretrain-timesteps 50000000

Each subcommand takes its script's own flags, runs that script's `train` for its pretraining budget only,
and leaves runs/<run_name>/final.pt: an IRU-K checkpoint that `--init-checkpoint` and eval_adaptive.py accept.
"""

import dataclasses
import sys

import tyro

import flexloop_gcdqn
import flexloop_gcppo
import flexloop_gciql

# subcommand -> (the script's Args with the paper's defaults, the script's train)
ALGORITHMS = {
    "gcdqn": (flexloop_gcdqn.Args(exp_name="iru_pretrain_gcdqn"), flexloop_gcdqn.train),
    "gcppo": (flexloop_gcppo.Args(exp_name="iru_pretrain_gcppo"), flexloop_gcppo.train),
    "gciql": (flexloop_gciql.Args(exp_name="iru_pretrain_gciql"), flexloop_gciql.train),
}


# the field holding each script's post-training budget (gcdqn: epochs, gciql: updates, gcppo: env steps)
POST_TRAINING_BUDGETS = ("num_epochs", "total_steps", "total_timesteps")


def pretrain_args(args):
    """The same flags as pretraining only: lambda 0, no init checkpoint, no post-training phase."""
    no_post_training = {name: 0 for name in POST_TRAINING_BUDGETS if hasattr(args, name)}
    return dataclasses.replace(args, lambda_depth=0.0, init_checkpoint=None, **no_post_training)


def main(algorithm, args):
    _, train = ALGORITHMS[algorithm]
    return train(pretrain_args(args))


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in ALGORITHMS:
        sys.exit(f"usage: python iru_pretrain.py {{{','.join(ALGORITHMS)}}} [the script's flags]\n"
                 f"       python iru_pretrain.py gcdqn --help")
    algorithm = sys.argv[1]
    default, _ = ALGORITHMS[algorithm]
    main(algorithm, tyro.cli(type(default), default=default, args=sys.argv[2:], prog=f"iru_pretrain.py {algorithm}"))
