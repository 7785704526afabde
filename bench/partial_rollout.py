"""Partial rollouts (issue 46) on the CPU demo: reward against training wall-clock, with and without, per seed.

    .venv/bin/python bench/partial_rollout.py [--seeds 0,1,2] [--overprovision 8] [--out DIR] [-- overrides]

Each seed runs examples/cpu_demo.yaml twice through launch_scripts/train.sh (2 ranks): as it is, and with
partial_rollout=True and rollout_overprovision. The clock is the sum of the logged step times (perf/step_time_s:
generation, scoring, update and sync, without start-up), so both runs are compared at the same training time T (the
shorter run's): the reward at T is the mean of the last 5 rounds before it. The partial runs' staleness (share of
trained tokens one version old), masked-token and carried-group figures are printed beside, and in how many rounds
the two runs' rewards were the same (with partial_rollout_adaptive a demo without a tail samples plain batches,
token for token those of the plain run). Figures, not assertions; the throughput side is bench/throughput.py
--partial-rollout on the long-tailed workload."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def curve(run_dir: str) -> list:
    """[(seconds of training so far, reward, the row)] per logged round."""
    rows, clock = [], 0.0
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        for line in fh:
            row = json.loads(line)
            if "reward" not in row or "perf/step_time_s" not in row:
                continue
            clock += row["perf/step_time_s"]
            rows.append((clock, row["reward"], row))
    return rows


def reward_at(rows: list, t: float) -> float:
    seen = [r for c, r, _ in rows if c <= t + 1e-9]
    last = seen[-5:]
    return sum(last) / max(1, len(last))


def mean_of(rows: list, key: str) -> float:
    vals = [row[key] for _, _, row in rows if key in row]
    return sum(vals) / max(1, len(vals))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--overprovision", type=int, default=8)
    p.add_argument("--out", default=os.path.join(REPO, "outputs", "bench_partial_rollout"))
    p.add_argument("extra", nargs="*", help="more overrides for both runs, after --")
    a = p.parse_args()
    init = os.path.join(a.out, "init_model")
    if not os.path.exists(os.path.join(init, "config.json")):
        subprocess.run([sys.executable, "-m", "dsgrpo.tasks", "warmup", "--out", init], cwd=REPO, check=True)
    modes = {"plain": [], "partial": ["--partial_rollout", "true", "--rollout_overprovision", str(a.overprovision)]}
    table = []
    for seed in (int(s) for s in a.seeds.split(",")):
        curves = {}
        for mode, flags in modes.items():
            run_dir = os.path.join(a.out, f"{mode}-seed{seed}")
            subprocess.run(["rm", "-rf", run_dir])
            cmd = [
                "bash",
                "launch_scripts/train.sh",
                "examples/cpu_demo.yaml",
                "--model",
                init,
                "--output_dir",
                run_dir,
                "--seed",
                str(seed),
                "--logging_steps",
                "1",
                *flags,
                *a.extra,
            ]
            proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=3600)
            if proc.returncode:
                print(f"seed {seed} {mode}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
                return 1
            curves[mode] = curve(run_dir)
        t = min(c[-1][0] for c in curves.values())
        row = {
            "seed": seed,
            "T": t,
            **{f"{m}_reward": reward_at(c, t) for m, c in curves.items()},
            **{f"{m}_total_s": c[-1][0] for m, c in curves.items()},
            "stale_tokens": mean_of(curves["partial"], "partial/staleness/1"),
            "masked": mean_of(curves["partial"], "sampling/token_band_masked"),
            "carried": mean_of(curves["partial"], "partial/groups_trained_carried"),
            "overprovisioned": mean_of(curves["partial"], "partial/overprovisioned"),
            "same_reward_rounds": sum(a[1] == b[1] for a, b in zip(curves["plain"], curves["partial"])),
            "rounds": min(len(c) for c in curves.values()),
            "plain_len": mean_of(curves["plain"], "completions/mean_length"),
            "partial_len": mean_of(curves["partial"], "completions/mean_length"),
        }
        table.append(row)
        print(
            f"seed {seed}: at T={t:.0f} s of training  plain {row['plain_reward']:.3f}  partial "
            f"{row['partial_reward']:.3f}  (whole runs {row['plain_total_s']:.0f} s / {row['partial_total_s']:.0f} s; "
            f"partial: {row['stale_tokens']:.1%} of tokens one version old, {row['masked']:.2%} masked by the band, "
            f"{row['carried']:.2f} carried groups trained a round; mean length {row['plain_len']:.2f} / "
            f"{row['partial_len']:.2f}; rounds over-provisioned {row['overprovisioned']:.1%}; the same reward as "
            f"plain in {row['same_reward_rounds']} of {row['rounds']} rounds)",
            flush=True,
        )
    worse = [r for r in table if r["partial_reward"] < r["plain_reward"]]
    same = [r for r in table if r["same_reward_rounds"] == r["rounds"]]
    print(
        f"partial not lower on {len(table) - len(worse)} of {len(table)} seeds at equal training time; the same "
        f"reward as plain in every round on {len(same)} of {len(table)} (there the runs differ only in how fast "
        f"the machine ran each: partial / plain training time "
        f"{sum(r['partial_total_s'] for r in same) / max(1, sum(r['plain_total_s'] for r in same)):.2f})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
