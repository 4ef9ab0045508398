"""Wall clock of adaptive inference alone: eval_adaptive.py's stress test without the evaluation.

    python bench/stress_test.py --checkpoints runs/X/final.pt --stress-eps 0.02
    python bench/stress_test.py --checkpoints runs/X/final.pt --stress-eps 0.02 --stress-envs 1024 --stress-mode compact

Whole BoxPick-Exact-4 env steps (policy + act + env.step) at full depth against compacted and masked adaptive
depth, CUDA-synchronised: median, IQR and mean per step, speed-up next to the ideal K / mean depth. Takes every flag of
eval_adaptive.py (defaults here: 1,024 and 32,768 envs, no evaluation); prints the JSON and writes results.json.
"""

import sys
from pathlib import Path

import tyro

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import eval_adaptive  # noqa: E402

if __name__ == "__main__":
    default = eval_adaptive.Args(exp_name="stress_test", skip_eval=True, stress_envs=(1024, 32768))
    eval_adaptive.main(tyro.cli(eval_adaptive.Args, default=default))
