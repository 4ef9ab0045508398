"""Fixed-depth IRU-K pretraining (lambda_depth = 0, fresh weights) through any FlexLoop script.

    python iru_pretrain.py gcdqn --env-id BoxPick-Exact-4-v0 --depth 5
    python iru_pretrain.py gcppo --pretrain-timesteps 50000000
    python iru_pretrain.py my_gcdqn.py --depth 8                 # your copy of a script
    python iru_pretrain.py gcdqn --help                          # the flags, with the values pretraining uses

The first argument is the script: gcdqn, gcppo or gciql (flexloop_<name>.py beside this file), or the path of a
FlexLoop script, such as your copy of one. The rest are that script's own flags. Its `train` runs the pretraining
phase only: the flags in the script's PRETRAINING_ONLY are fixed (lambda_depth 0, no post-training budget, no
--init-checkpoint). The run leaves runs/<run_name>/final.pt, an IRU-K checkpoint that --init-checkpoint and
eval_adaptive.py accept.
"""

import dataclasses
import sys
from pathlib import Path

import flexloop_run

SHORT_NAMES = ("gcdqn", "gcppo", "gciql")
USAGE = ("usage: python iru_pretrain.py {gcdqn,gcppo,gciql,PATH.py} [the script's flags]\n"
         "       python iru_pretrain.py gcdqn --help      (the script's flags, with the values pretraining uses)")


def load_script(script):
    """The module of a FlexLoop script: gcdqn, gcppo or gciql, or the path of a FlexLoop script. A file that is not
    one is refused before anything is imported from it (flexloop_run.import_script)."""
    if script in SHORT_NAMES:
        return flexloop_run.import_script(Path(__file__).resolve().parent / f"flexloop_{script}.py")
    return flexloop_run.import_script(script)


def pretrain_default(module):
    """The script's default flags as pretraining runs them (--help shows these)."""
    name = f"iru_pretrain_{flexloop_run.script_name(module).removeprefix('flexloop_')}"
    return dataclasses.replace(module.Args(exp_name=name), **module.PRETRAINING_ONLY)


def pretrain_args(args):
    """The same flags with the script's PRETRAINING_ONLY: lambda_depth 0, no post-training, no init checkpoint."""
    module = sys.modules[type(args).__module__]
    return dataclasses.replace(args, **module.PRETRAINING_ONLY)


def main(script, args):
    """Pretrain with `script` (a name, a path or the module itself) and these flags; returns the run folder."""
    module = load_script(script) if isinstance(script, (str, Path)) else script
    return module.train(pretrain_args(args))


def cli(argv):
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__ + "\n" + USAGE)
        sys.exit(0 if argv else 2)
    if argv[0] not in SHORT_NAMES and not argv[0].endswith(".py"):
        sys.exit(f"iru_pretrain.py: {argv[0]!r} is not a script; give gcdqn, gcppo, gciql or the path of a FlexLoop "
                 f"script (a .py file)\n{USAGE}")
    with flexloop_run.errors_in_one_line():
        module = load_script(argv[0])
        args = flexloop_run.parse_args(module.Args, argv[1:], default=pretrain_default(module),
                                       prog=f"iru_pretrain.py {argv[0]}", description=module.__doc__)
        changed = [f"--{name.replace('_', '-')}" for name, value in module.PRETRAINING_ONLY.items()
                   if getattr(args, name) != value]
        if changed:
            raise ValueError(f"iru_pretrain.py fixes {', '.join(changed)} (pretraining is lambda_depth 0, with no "
                             "post-training and no init checkpoint); drop them, or run "
                             f"{flexloop_run.script_name(module)}.py for FlexLoop post-training")
        return main(module, args)


if __name__ == "__main__":
    cli(sys.argv[1:])
