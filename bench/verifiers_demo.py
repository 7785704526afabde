"""Issue 66's example, measured: examples/cpu_verifiers.yaml (the demo's copy-digits task served by a verifiers v1
taskset in the env host's own venv) from the demo's warm-up model, seeds 0-2, one after another on 2 CPU ranks
(launch_scripts/train.sh), the clock from launch. Prints each seed's first-round reward, the mean of its last 5
rounds, when the 5-round mean first reached twice the first round's, and the run's seconds; draws the curves to
docs/verifiers_demo.png.

    .venv/bin/python bench/verifiers_demo.py [--steps 40] [--seeds 0 1 2] [--out outputs/verifiers_demo]

The warm-up model is built first if missing (python -m dsgrpo.tasks warmup), the verifiers venv on first use."""

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from time_to_reward import dsgrpo_run, smoothed  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", default=os.path.join(REPO, "outputs", "verifiers_demo"))
    parser.add_argument("--cap", type=float, default=600.0, help="seconds a seed may run")
    a = parser.parse_args()
    init = os.path.join(REPO, "outputs", "demo", "init_model")
    if not os.path.exists(os.path.join(init, "warmup.json")):
        subprocess.run([sys.executable, "-m", "dsgrpo.tasks", "warmup", "--out", init], cwd=REPO, check=True)
    table, curves = [], {}
    for seed in a.seeds:
        out = os.path.join(a.out, f"seed{seed}")
        curve = dsgrpo_run(init, out, seed, a.steps, a.cap, config="examples/cpu_verifiers.yaml")
        if not curve:
            print(f"seed {seed}: no round logged (see {out}/train.log)")
            return 1
        points = smoothed(curve)
        first = curve[0]["reward"]
        doubled = next((t for t, r in points if r >= 2 * first), None)
        last = [r["reward"] for r in curve[-5:]]
        row = {
            "seed": seed,
            "rounds": len(curve),
            "first_round_reward": round(first, 3),
            "last_5_rounds_reward": round(sum(last) / len(last), 3),
            "seconds_to_2x": None if doubled is None else round(doubled, 1),
            "first_round_logged_s": round(curve[0]["t"], 1),
            "run_s": round(curve[-1]["t"], 1),
        }
        table.append(row)
        curves[seed] = curve
        print(json.dumps(row), flush=True)
    with open(os.path.join(a.out, "table.json"), "w") as fh:
        json.dump(table, fh, indent=1)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for seed, curve in curves.items():
            ax.plot([r["t"] for r in curve], [r["reward"] for r in curve], label=f"seed {seed}")
        ax.set_xlabel("seconds since launch")
        ax.set_ylabel("reward (digit positions right)")
        ax.set_title("copy_digits as a verifiers v1 taskset, env host on 2 CPU ranks")
        ax.set_ylim(0, 1.05)
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(REPO, "docs", "verifiers_demo.png"), dpi=110)
    except ImportError:
        print("matplotlib is not installed: no figure")
    return 0


if __name__ == "__main__":
    sys.exit(main())
