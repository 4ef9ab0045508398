"""The paper's studies, which reproduce.py runs: each study is its runs (a script and its flags, per seed), what each
run starts from, the evaluations, and the tables they feed.

    python reproduce.py --list                          # these studies
    python reproduce.py boxpick-exact4 --seeds 1 2 3    # run one to completion and print its table

How to read a study:
- A run's flags may name another run of the same study in braces. "{pretrain}" is where run `pretrain` of the same
  seed writes: its run folder (a training run), its output folder (an evaluation) or the dataset folder (a dataset).
  So "--init-checkpoint {pretrain}/final.pt" starts a run from the pretraining's checkpoint (iru_pretrain.py's
  final.pt is the IRU-K at the end of pretraining), and the run waits until `pretrain` has finished. Nothing else
  orders the runs. A run's own name is its own output: the dataset's --out.
- Every evaluation (eval_adaptive.py) feeds one table over the seeds' results.json: bench/seed_table.py's, or
  for OGBench's tasks (which seed_table.py does not read) reproduce.py's own, per task.
- A run with `home` set is another study's run, shared: it lives in that study's folder and runs once for both
  (the ablations post-train the IRU-5 of boxpick-exact4, and compare with its FlexLoop).
- Budgets are written out, not left to the scripts' defaults, so that a study says what it runs. A Budget holds the
  flags that size the runs; the tests build the same studies with a tiny Budget.

Budgets are the paper's (docs/reference.md), except where a comment says otherwise.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Run:
    name: str  # unique in its study: pretrain, flexloop, control, eval, data, ...
    kind: str  # train: a FlexLoop script (done: final.pt; resumes from latest.pt); eval: eval_adaptive.py
    #            (done: results.json); data: an OGBench dataset (done: its .npz files)
    command: tuple  # python's arguments: a script or -m module, then its flags
    home: str = None  # the study whose folder holds this run, when it is another study's (shared)
    per_seed: bool = True  # False: one run for every seed (a dataset)
    creates: tuple = ()  # data runs: the files in the dataset folder (--data-dir) that say it is done
    seeds: tuple = None  # only these of the seeds run (None: every one)


@dataclass(frozen=True)
class Study:
    name: str
    about: str  # one line: what it reproduces, and where in the paper
    runs: tuple
    seeds: tuple = (1, 2, 3)


@dataclass(frozen=True)
class Budget:
    """The flags that size a study's runs, added before the study's own flags (a later flag wins)."""
    pretrain: tuple  # the IRU-K pretraining
    post: tuple  # every post-training run: FlexLoop, the controls, the ablations
    eval: tuple = ()  # eval_adaptive.py
    data: tuple = ()  # envs.ogbench_data generate


def train(name, script, *flags, home=None, seeds=None):
    return Run(name, "train", (script, *flags), home=home, seeds=seeds)


def evaluate(name, checkpoints, *flags, seeds=None):
    """eval_adaptive.py on {label: checkpoint path}, in that order (the table's rows)."""
    return Run(name, "eval", ("eval_adaptive.py", "--checkpoints", *checkpoints.values(),
                              "--labels", *checkpoints, *flags), seeds=seeds)


# ------------------------------------------------------------------------------------------------- BoxPick (GC-DQN)

GCDQN = "flexloop_gcdqn.py"
# 50 epochs x 100 iterations x 1,000 updates = 5M updates of IRU-5 pretraining, then 1M of post-training
BOXPICK = Budget(pretrain=("--pretrain-epochs", "50"), post=("--num-epochs", "10"), eval=("--num-eval-envs", "1024"))
BOXPICK_VARIANTS = {"exact4": "BoxPick-Exact-4-v0", "exact3": "BoxPick-Exact-3-v0",
                    "generalize41": "BoxPick-Generalize-4-1-v0", "generalize42": "BoxPick-Generalize-4-2-v0"}


def boxpick_pretrain(env_id, budget, *flags, name="pretrain", home=None):
    return train(name, "iru_pretrain.py", "gcdqn", "--env-id", env_id, *budget.pretrain, *flags, home=home)


def boxpick_post(name, env_id, budget, *flags, start="pretrain", home=None):
    """A post-training run from the pretraining `start`'s IRU-K (its final.pt)."""
    return train(name, GCDQN, "--env-id", env_id, *budget.post, "--init-checkpoint", f"{{{start}}}/final.pt",
                 *flags, home=home)


def boxpick_main(variant, budget=BOXPICK, name=None):
    """IRU-5 pretraining, then FlexLoop (lambda 1) and the RL loss alone (Self-TD Only, lambda 0) from the same
    pretrained IRU-5, each evaluated on the train and unseen splits."""
    env_id = BOXPICK_VARIANTS[variant]
    return Study(name or f"boxpick-{variant}", f"{env_id}: IRU-5 5M updates, then FlexLoop and Self-TD Only 1M "
                 "(paper §5, Table 2, appendix table)", (
        boxpick_pretrain(env_id, budget),
        boxpick_post("flexloop", env_id, budget, "--lambda-depth", "1"),
        boxpick_post("control", env_id, budget, "--lambda-depth", "0"),
        evaluate("eval", {"IRU-5": "{pretrain}/final.pt", "FlexLoop": "{flexloop}/final.pt",
                          "Self-TD-Only": "{control}/final.pt"}, *budget.eval),
    ))


def exact4_shared(budget, control=False):
    """boxpick-exact4's pretraining and FlexLoop (and its Self-TD Only control), which the ablations start from and
    compare with."""
    env_id = BOXPICK_VARIANTS["exact4"]
    return (boxpick_pretrain(env_id, budget, home="boxpick-exact4"),
            boxpick_post("flexloop", env_id, budget, "--lambda-depth", "1", home="boxpick-exact4"),
            *[boxpick_post("control", env_id, budget, "--lambda-depth", "0", home="boxpick-exact4")] * control)


def ablation(name, about, variants, budget=BOXPICK, control=False):
    """Post-training variants {label: flags} from boxpick-exact4's pretrained IRU-5, evaluated beside its FlexLoop
    (and its Self-TD Only control)."""
    env_id = BOXPICK_VARIANTS["exact4"]
    runs = [boxpick_post(label.lower(), env_id, budget, *flags) for label, flags in variants.items()]
    checkpoints = {"IRU-5": "{pretrain}/final.pt", "FlexLoop": "{flexloop}/final.pt",
                   **({"Self-TD-Only": "{control}/final.pt"} if control else {}),
                   **{label: f"{{{label.lower()}}}/final.pt" for label in variants}}
    return Study(name, about, (*exact4_shared(budget, control), *runs, evaluate("eval", checkpoints, *budget.eval)))


def own_pretraining(name, about, variants, budget=BOXPICK):
    """Variants that change the network, so each pretrains its own IRU (or LSTM) on BoxPick-Exact-4 then runs
    FlexLoop: {label: network flags}; one evaluation of them all."""
    env_id = BOXPICK_VARIANTS["exact4"]
    runs, checkpoints = [], {}
    for label, flags in variants.items():
        key = label.lower()
        runs += [boxpick_pretrain(env_id, budget, *flags, name=f"pretrain-{key}"),
                 boxpick_post(f"flexloop-{key}", env_id, budget, *flags, "--lambda-depth", "1",
                              start=f"pretrain-{key}")]
        flexloop = label.replace("IRU", "FlexLoop") if label.startswith("IRU") else f"FlexLoop-{label}"
        checkpoints |= {label: f"{{pretrain-{key}}}/final.pt", flexloop: f"{{flexloop-{key}}}/final.pt"}
    return Study(name, about, (*runs, evaluate("eval", checkpoints, *budget.eval)))


def depth_k(k, budget=BOXPICK):
    """IRU-K pretrained then FlexLoop-K: one study per K, since a table holds one K."""
    return own_pretraining(f"depth-k{k}", f"BoxPick-Exact-4: IRU-{k} then FlexLoop-{k} (appendix C.2; K = 10 is "
                           "Table 3's IRU-10)", {f"IRU-{k}": ("--depth", str(k))}, budget)


def from_scratch(budget=BOXPICK):
    """FlexLoop from fresh weights with boxpick-exact4's pretrained IRU-5 as an output-only teacher. The paper does
    not give its budget: the post-training's 1M updates."""
    env_id = BOXPICK_VARIANTS["exact4"]
    scratch = train("scratch", GCDQN, "--env-id", env_id, *budget.post, "--teacher-checkpoint",
                    "{pretrain}/final.pt", "--bellman-weight", "0.1")
    return Study("ablation-from-scratch", "BoxPick-Exact-4: FlexLoop from scratch with an output-only IRU-5 teacher "
                 "(appendix C.1)", (*exact4_shared(budget), scratch, evaluate(
                     "eval", {"IRU-5": "{pretrain}/final.pt", "FlexLoop": "{flexloop}/final.pt",
                              "FlexLoop-scratch": "{scratch}/final.pt"}, *budget.eval)))


# ---------------------------------------------------------------------------------------------- LightsOut (GC-PPO)

# The paper does not state LightsOut's budget: 200M env steps of pretraining (where IRU-5 reaches the paper's 0.73,
# README) and the script's 50M of FlexLoop.
LIGHTSOUT = Budget(pretrain=("--pretrain-timesteps", "200000000", "--eval-every", "8"),
                   post=("--total-timesteps", "50000000", "--eval-every", "8"), eval=("--num-eval-envs", "1024"))


def lightsout(budget=LIGHTSOUT, name="lightsout"):
    """IRU-5 GC-PPO pretraining, then FlexLoop (lambda 0.05) and the control (lambda 0) from it."""
    post = ("flexloop_gcppo.py", *budget.post, "--init-checkpoint", "{pretrain}/final.pt")
    return Study(name, "LightsOut-4x5: IRU-5 GC-PPO 200M env steps, then FlexLoop and the control 50M (paper §5, "
                 "Table 2)", (
        train("pretrain", "iru_pretrain.py", "gcppo", *budget.pretrain),
        train("flexloop", *post, "--lambda-depth", "0.05"),
        train("control", *post, "--lambda-depth", "0"),
        evaluate("eval", {"IRU-5": "{pretrain}/final.pt", "FlexLoop": "{flexloop}/final.pt",
                          "Self-TD-Only": "{control}/final.pt"}, *budget.eval),
    ))


# ----------------------------------------------------------------------------------------------- OGBench (GC-IQL)

# 1M updates of IRU-5 pretraining, then 1M of post-training; evaluation: 50 episodes per task (eval_adaptive.py's)
OGBENCH = Budget(pretrain=("--pretrain-steps", "1000000", "--hidden-dim", "256"),
                 post=("--total-steps", "1000000", "--hidden-dim", "256"))
OGBENCH_DATASETS = {  # study name: (dataset, FlexLoop's lambda_depth, docs/reference.md, OGBench)
    "ogbench-scene": ("scene-play-v0", "0.05"), "ogbench-cube-double": ("cube-double-play-v0", "0.02"),
    "ogbench-puzzle-4x4": ("puzzle-4x4-play-v0", "0.2"), "ogbench-antmaze-medium": ("antmaze-medium-stitch-v0", "0.03"),
    "ogbench-pointmaze-large": ("pointmaze-large-stitch-v0", "0.3")}


def ogbench(name, budget=OGBENCH):
    """The dataset (skipped when it is already in --data-dir, downloaded or generated), IRU-5 GC-IQL pretraining,
    then FlexLoop from it; for seed 1 also the control (lambda 0), evaluated apart: one seed of it says whether
    FlexLoop's numbers come from the depth loss or from 1M more updates."""
    dataset, lambda_depth = OGBENCH_DATASETS[name]
    data = Run("data", "data", ("-m", "envs.ogbench_data", "generate", "--env", dataset, "--out", "{data}",
                                *budget.data), per_seed=False, creates=(f"{dataset}.npz", f"{dataset}-val.npz"))
    on_data = ("--env-name", dataset, "--dataset-dir", "{data}", "--no-download")
    post = ("flexloop_gciql.py", *on_data, *budget.post, "--init-checkpoint", "{pretrain}/final.pt")
    return Study(name, f"OGBench {dataset}: IRU-5 GC-IQL 1M updates, then FlexLoop (lambda {lambda_depth}) 1M, and "
                 "for seed 1 the control 1M (paper §5, Table 2)", (
        data,
        train("pretrain", "iru_pretrain.py", "gciql", *on_data, *budget.pretrain),
        train("flexloop", *post, "--lambda-depth", lambda_depth),
        train("control", *post, "--lambda-depth", "0", seeds=(1,)),
        evaluate("eval", {"IRU-5": "{pretrain}/final.pt", "FlexLoop": "{flexloop}/final.pt"}, *budget.eval),
        evaluate("eval-control", {"Self-TD-Only": "{control}/final.pt"}, *budget.eval, seeds=(1,)),
    ))


# ------------------------------------------------------------------------------------------------------ the list

STUDIES = {study.name: study for study in [
    *(boxpick_main(variant) for variant in BOXPICK_VARIANTS),
    lightsout(),
    *(ogbench(name) for name in OGBENCH_DATASETS),
    ablation("ablation-components", "BoxPick-Exact-4: Self-TD Only, Distill Only and AnyK-TD against FlexLoop "
             "(paper §5.4)", {"Distill-Only": ("--ablation", "distill-only", "--lambda-depth", "1"),
                              "AnyK-TD": ("--ablation", "anyk-td", "--lambda-depth", "0")}, control=True),
    ablation("ablation-lambda", "BoxPick-Exact-4: lambda_depth 0 (Self-TD Only), 0.1, 0.3, 3 and 10 against "
             "FlexLoop's 1 (paper §5.4)", {f"lambda-{value}": ("--lambda-depth", value)
                                           for value in ("0.1", "0.3", "3", "10")}, control=True),
    ablation("ablation-depth-target", "BoxPick-Exact-4: every depth distilled from depth K (--depth-target final) "
             "against the adjacent depth", {"Final-target": ("--depth-target", "final")}),
    own_pretraining("ablation-lstm", "BoxPick-Exact-4: LSTM-256 and LSTM-184 backbones, pretrained then FlexLoop "
                    "(paper §5.4)", {"LSTM-256": ("--backbone", "lstm", "--hidden-dim", "256"),
                                     "LSTM-184": ("--backbone", "lstm", "--hidden-dim", "184")}),
    *(depth_k(k) for k in (4, 8, 10)),
    from_scratch(),
]}
