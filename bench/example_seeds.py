"""Issue 66's examples, measured: seeds 0-2 of one example, one after another on 2 CPU ranks
(launch_scripts/train.sh), the clock from launch. Prints each seed's first-round reward, the mean of its last 5
rounds, when the 5-round mean first reached twice the first round's, and the run's seconds; draws the curves to
docs/<example>_demo.png.

- verifiers: examples/cpu_verifiers.yaml, the demo's copy-digits task served by a verifiers v1 taskset in the env
  host's own venv, from the demo's warm-up model (the verifiers venv is built on first use);
- reasoning_gym: examples/cpu_reasoning_gym.yaml, reasoning-gym's chain_sum scored by its own scorer, from its
  warm-up model (python -m dsgrpo.tasks warmup --task reasoning_gym).

    .venv/bin/python bench/example_seeds.py --example verifiers|reasoning_gym [--steps N] [--seeds 0 1 2]

The warm-up model is built first if missing."""

import argparse
import json
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from time_to_reward import dsgrpo_run, smoothed  # noqa: E402


# example -> (config, warm-up task, its model, steps, the reward's name on the plot, the plot's title)
EXAMPLES = {
    "verifiers": (
        "examples/cpu_verifiers.yaml",
        "copy_digits",
        "outputs/demo/init_model",
        40,
        "reward (digit positions right)",
        "copy_digits as a verifiers v1 taskset, env host on 2 CPU ranks",
    ),
    "reasoning_gym": (
        "examples/cpu_reasoning_gym.yaml",
        "reasoning_gym",
        "outputs/reasoning_gym/init_model",
        100,
        "reward (reasoning-gym's score)",
        "reasoning-gym chain_sum (one-digit), 2 CPU ranks",
    ),
}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--example", choices=sorted(EXAMPLES), required=True)
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps (the example's: 40 / 100)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", default=None, help="default: outputs/<example>_demo")
    parser.add_argument("--cap", type=float, default=600.0, help="seconds a seed may run")
    a = parser.parse_args()
    config, task, init, steps, ylabel, title = EXAMPLES[a.example]
    a.steps = a.steps or steps
    a.out = a.out or os.path.join(REPO, "outputs", f"{a.example}_demo")
    init = os.path.join(REPO, init)
    if not os.path.exists(os.path.join(init, "warmup.json")):
        warmup = [sys.executable, "-m", "dsgrpo.tasks", "warmup", "--task", task, "--out", init]
        subprocess.run(warmup, cwd=REPO, check=True)
    table, curves = [], {}
    for seed in a.seeds:
        out = os.path.join(a.out, f"seed{seed}")
        shutil.rmtree(out, ignore_errors=True)  # an earlier run's metrics.jsonl would be read as this one's
        curve = dsgrpo_run(init, out, seed, a.steps, a.cap, config=config)
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
    os.makedirs(a.out, exist_ok=True)
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
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.set_ylim(0, 1.05)
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(REPO, "docs", f"{a.example}_demo.png"), dpi=110)
    except ImportError:
        print("matplotlib is not installed: no figure")
    return 0


if __name__ == "__main__":
    sys.exit(main())
