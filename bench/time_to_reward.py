"""Reward against wall-clock, dsgrpo beside TRL 1.16 on the same machine (issue 48): what users choose by.

    .venv/bin/python bench/time_to_reward.py [--seeds 0,1,2,3,4] [--steps 150] [--cap-s 300] [--out DIR]
    .venv/bin/python bench/time_to_reward.py --recipe gpu      # a GPU machine: GSM8K, Qwen2.5-0.5B-Instruct

The CPU task is the demo (examples/cpu_demo.yaml): copy_digits from the same warm-up model (dsgrpo.tasks.copy_warmup:
right one digit in five when sampled), with the same hyperparameters for both trainers (G 16, 8 prompts a step,
max_completion_length 8, learning rate 7e-4 constant, beta 0, loss dapo, temperature 1, 150 steps). dsgrpo runs at
its defaults through launch_scripts/train.sh (2 ranks, colocated vLLM); TRL runs its GRPOTrainer at its best CPU
setting (one process, transformers generation, no gradient checkpointing: bench/speed_table.py measured it fastest;
TRL's colocated vLLM cannot sync weights into vLLM-CPU). Each run is stopped at --cap-s. The clock starts when the
process starts (start-up counts: a user waits for it).

Per run, the reward curve is the mean of the last 5 rounds against seconds since launch; printed per trainer and
seed: the time to reach 0.5 and 0.8 and the reward after 30 s and 60 s; then each trainer's median time to each
level over the seeds and a PNG of all curves (matplotlib when installed). Goal (issue 54): dsgrpo's median at most
0.5x TRL's at both levels, and no seed where TRL reaches a level that dsgrpo does not."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU_RECIPE = dict(per_device=64, generations=16, completion=8, lr=7e-4)  # examples/cpu_demo.yaml's

TRL_SCRIPT = r"""
import json, os, sys, time
start = float(sys.argv[1]); out = sys.argv[2]; model = sys.argv[3]; seed = int(sys.argv[4]); steps = int(sys.argv[5])
cap = float(sys.argv[6])
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer
from dsgrpo.tasks import copy_digits_dataset, copy_digits_reward
rows = open(os.path.join(out, "curve.jsonl"), "w")
class Clock(TrainerCallback):
    def on_log(self, args, state, control, logs=None, **kw):
        if logs and "reward" in logs:
            rows.write(json.dumps({"t": time.time() - start, "step": state.global_step, "reward": logs["reward"]}) + "\n")
            rows.flush()
        if time.time() - start > cap:
            control.should_training_stop = True
args = GRPOConfig(output_dir=out, max_steps=steps, per_device_train_batch_size=128, num_generations=16,
                  max_completion_length=8, learning_rate=7e-4, lr_scheduler_type="constant", beta=0.0,
                  loss_type="dapo", temperature=1.0, gradient_checkpointing=False, logging_steps=1, bf16=False,
                  use_cpu=True, use_vllm=False, report_to="none", save_strategy="no", seed=seed,
                  dataloader_num_workers=0)
GRPOTrainer(model, copy_digits_reward, args=args, train_dataset=copy_digits_dataset(), callbacks=[Clock()]).train()
"""


def dsgrpo_run(init: str, out: str, seed: int, steps: int, cap: float, config: str = "examples/cpu_demo.yaml") -> list:
    start = time.time()
    cmd = [
        "bash",
        "launch_scripts/train.sh",
        config,
        "--model",
        init,
        "--output_dir",
        out,
        "--seed",
        str(seed),
        "--max_steps",
        str(steps),
        "--logging_steps",
        "1",
    ]
    os.makedirs(out, exist_ok=True)
    log = open(os.path.join(out, "train.log"), "w")  # a pipe nobody reads fills at 64 KiB and stalls the run
    from dsgrpo.testing import _free_port

    # its own session, so the cap ends the ranks too (the launcher alone would leave them holding the port)
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env={**os.environ, "MASTER_PORT": str(_free_port())},
    )
    curve, metrics = [], os.path.join(out, "metrics.jsonl")
    seen = 0
    while proc.poll() is None:
        time.sleep(0.2)  # a row is stamped when it is read
        seen = _read_new(metrics, seen, curve, start)
        if time.time() - start > cap:
            break
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    log.close()
    _read_new(metrics, seen, curve, start)
    return curve


def _read_new(path: str, seen: int, curve: list, start: float) -> int:
    """Rows of metrics.jsonl past the first `seen`, stamped with the time they were read."""
    if not os.path.exists(path):
        return seen
    with open(path) as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    for row in rows[seen:]:
        if "reward" in row and "train_runtime" not in row:
            curve.append({"t": time.time() - start, "step": row["step"], "reward": row["reward"]})
    return len(rows)


def trl_run(init: str, out: str, seed: int, steps: int, cap: float) -> list:
    os.makedirs(out, exist_ok=True)
    start = time.time()
    subprocess.run(
        [sys.executable, "-c", TRL_SCRIPT, str(start), out, init, str(seed), str(steps), str(cap)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": REPO},
        capture_output=True,
        text=True,
        timeout=cap + 600,
    )
    with open(os.path.join(out, "curve.jsonl")) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def smoothed(curve: list) -> list:
    """(seconds, mean reward of the last 5 rounds) per round."""
    out = []
    for i, row in enumerate(curve):
        last = [r["reward"] for r in curve[max(0, i - 4) : i + 1]]
        out.append((row["t"], sum(last) / len(last)))
    return out


def time_to(points: list, level: float):
    return next((t for t, r in points if r >= level), None)


def reward_after(points: list, seconds: float):
    before = [r for t, r in points if t <= seconds]
    return before[-1] if before else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="0,1,2,3,4")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--cap-s", type=float, default=300.0, help="stop each run after this many seconds")
    p.add_argument("--trainers", default="dsgrpo,trl")
    p.add_argument("--recipe", default="cpu", choices=["cpu", "gpu"])
    p.add_argument("--out", default=os.path.join(REPO, "outputs", "time_to_reward"))
    a = p.parse_args()
    if a.recipe == "gpu":
        print(
            "GPU recipe: run `launch_scripts/train.sh examples/gsm8k_qwen2.5_0.5b.yaml --logging_steps 1` and TRL's "
            "GRPOTrainer with the same fields (its vLLM colocated), then this script's curve functions on both "
            "metrics files; this machine has no GPU to run it on."
        )
        return 2
    os.makedirs(a.out, exist_ok=True)
    init = os.path.join(a.out, "init_model")  # rebuilt when its recipe is not today's
    subprocess.run([sys.executable, "-m", "dsgrpo.tasks", "warmup", "--out", init], cwd=REPO, check=True)
    runs = {}
    for trainer in a.trainers.split(","):
        for seed in (int(s) for s in a.seeds.split(",")):
            out = os.path.join(a.out, f"{trainer}-seed{seed}")
            subprocess.run(["rm", "-rf", out])
            curve = (dsgrpo_run if trainer == "dsgrpo" else trl_run)(init, out, seed, a.steps, a.cap_s)
            runs[(trainer, seed)] = smoothed(curve)
            pts = runs[(trainer, seed)]
            fmt = lambda x: "-" if x is None else f"{x:.0f}"  # noqa: E731
            fr = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
            print(
                f"{trainer:6s} seed {seed}: to 0.5 {fmt(time_to(pts, 0.5))} s, to 0.8 {fmt(time_to(pts, 0.8))} s, "
                f"reward after 30 s {fr(reward_after(pts, 30))}, after 60 s {fr(reward_after(pts, 60))}, "
                f"first round at {fmt(pts[0][0] if pts else None)} s, {len(pts)} rounds in "
                f"{fmt(pts[-1][0] if pts else None)} s",
                flush=True,
            )
    with open(os.path.join(a.out, "curves.json"), "w") as fh:
        json.dump({f"{k[0]}-{k[1]}": v for k, v in runs.items()}, fh)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for (trainer, seed), pts in runs.items():
            ax.plot(
                [t for t, _ in pts],
                [r for _, r in pts],
                color="C0" if trainer == "dsgrpo" else "C1",
                alpha=0.8,
                label=f"{trainer} seed {seed}",
            )
        ax.set_xlabel("seconds since launch (2-core CPU)")
        ax.set_ylabel("reward (mean of last 5 rounds)")
        ax.set_title("copy_digits: dsgrpo (2 ranks, vLLM) vs TRL 1.16 (best CPU setting)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(a.out, "time_to_reward.png"), dpi=110)
        print(f"plot: {os.path.join(a.out, 'time_to_reward.png')}")
    except ImportError:
        print("matplotlib is not installed: no plot (curves.json has the points)")
    import statistics

    seeds = sorted({seed for _, seed in runs})
    for level in (0.5, 0.8):
        times = {
            t: [time_to(runs[(t, seed)], level) if (t, seed) in runs else None for seed in seeds]
            for t in ("dsgrpo", "trl")
        }
        medians = {
            t: statistics.median(x for x in v if x is not None) if any(x is not None for x in v) else None
            for t, v in times.items()
        }
        missed = [seed for seed, d, r in zip(seeds, times["dsgrpo"], times["trl"]) if d is None and r is not None]
        line = "  ".join(
            f"{t}: median {medians[t]:.1f} s ({sum(x is not None for x in v)}/{len(v)} seeds)"
            if medians[t] is not None
            else f"{t}: never"
            for t, v in times.items()
        )
        ratio = (
            f", dsgrpo/TRL {medians['dsgrpo'] / medians['trl']:.2f}x"
            if medians["dsgrpo"] is not None and medians["trl"]
            else ""
        )
        print(f"time to {level}: {line}{ratio}; seeds where TRL reached it and dsgrpo did not: {missed or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
