"""Does the CPU environment example learn, whatever the seed? For each seed: the Door warm-up with that seed
(`python -m dsgrpo.tasks warmup --task door`), then examples/cpu_door.yaml (launch_scripts/train.sh, 2 ranks,
environment_factory=dsgrpo.tasks:Door) with that seed. Prints per run the mean reward of the first and last 5
generation rounds (the trainer's summary line), their ratio, the share of episodes that made a wasted or failed
call at the end, the warm-up's and the run's wall time, and episodes per second; plots every run's curve.

    .venv/bin/python bench/environment_example.py [--seeds 0,1,2] [--out DIR] [--plot docs/environment_example.png]
                                                  [-- overrides for the example's config]

Goal (issue 55): last 5 rounds ≥ 3× the first 5, each seed within 10 minutes on 2 cores (warm-up and run).
Figures, not assertions."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from demo_robustness import REPO, launch  # train.sh with its output kept and its summary line read


def run(seed: int, out: str, extra: list) -> dict:
    init, run_dir = os.path.join(out, f"init_model-seed{seed}"), os.path.join(out, f"seed{seed}")
    start = time.time()
    subprocess.run(
        [sys.executable, "-m", "dsgrpo.tasks", "warmup", "--task", "door", "--seed", str(seed), "--out", init],
        cwd=REPO,
        check=True,
        capture_output=True,
    )
    warmup = time.time() - start
    cmd = [
        "bash",
        "launch_scripts/train.sh",
        "examples/cpu_door.yaml",
        "--model",
        init,
        "--output_dir",
        run_dir,
        "--seed",
        str(seed),
        "--logging_steps",
        "1",
        *extra,
    ]
    found, wall, error = launch(cmd, run_dir)
    if error:
        return {"seed": seed, "error": error, "wall": wall}
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl")) if line.strip()]
    rows = [r for r in rows if "reward" in r]
    per_round = 2 * 32  # the example's episodes a round: 2 ranks x per_device_train_batch_size
    round_s = sum(r["perf/step_time_s"] for r in rows)
    tools_s = sum(r["env/step_s"] * r["tools/calls_per_episode"] * per_round / 2 for r in rows)  # a rank's share
    first, last = found
    return {
        "seed": seed,
        "first": first,
        "last": last,
        "ratio": last / max(first, 1e-9),
        "warmup": warmup,
        "wall": wall,
        "curve": [(r["step"], r["reward"]) for r in rows],
        "calls_last": sum(r["tools/calls_per_episode"] for r in rows[-5:]) / 5,
        "episodes_per_s": per_round * len(rows) / round_s,
        "env_share": tools_s / round_s,
        "generate_share": sum(r["time/generate"] for r in rows) / round_s,
    }


def plot(done: list, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2))
    for r in done:
        steps, rewards = zip(*r["curve"])
        ax.plot(steps, rewards, label=f"seed {r['seed']}", linewidth=1)
    ax.set_xlabel("optimizer step (one round of 64 episodes)")
    ax.set_ylabel("mean episode reward")
    ax.set_ylim(0, 1.05)
    ax.set_title("examples/cpu_door.yaml: environment_factory on 2 CPU ranks")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--out", default=os.path.join(REPO, "outputs", "environment_example"))
    parser.add_argument("--plot", default=None, help="write the curves to this PNG")
    parser.add_argument("extra", nargs="*", help="more overrides for the example's config, after --")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    results = []
    for seed in (int(s) for s in args.seeds.split(",")):
        r = run(seed, args.out, args.extra)
        results.append(r)
        if "error" in r:
            print(f"seed {seed}: {r['error']}", flush=True)
            continue
        ok = r["ratio"] >= 3 and r["warmup"] + r["wall"] <= 600
        rate = (
            f"{r['episodes_per_s']:.1f} episodes/s, generation (tool turns included) {r['generate_share']:.0%} "
            f"of a round, the environment's calls {r['env_share']:.2%}"
        )
        print(
            f"seed {seed}: first 5 {r['first']:.3f}  last 5 {r['last']:.3f}  ({r['ratio']:.1f}x)  tool calls an "
            f"episode at the end {r['calls_last']:.2f}  warm-up {r['warmup']:.0f} s + run {r['wall']:.0f} s  "
            f"{rate}  {'ok' if ok else 'MISSED'}",
            flush=True,
        )
    done = [r for r in results if "error" not in r]
    if done and args.plot:
        plot(done, args.plot)
        print(f"curves: {args.plot}")
    with open(os.path.join(args.out, "environment_example.json"), "w") as fh:
        json.dump(results, fh, indent=1)
    return 0 if len(done) == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
