"""Drift at learning rate 0: with no update, every weight sync reloads the same weights, so the gap between the
sampler's log-probs (vLLM) and the trainer's must stay flat over a long run. A sync that loses precision, reuses
stale state or leaves the prefix cache stale shows up as a gap that grows (a reported failure of other trainers).

    python bench/weight_drift.py [--steps 200] [--zero 3] [--model qwen2-tied]

One 2-rank launch (torchrun) of GRPOTrainer with learning_rate=0, fp32 on CPU, colocated vLLM, a sync after every
step. Prints the gap (mean and max over a step's tokens of |sampler − trainer| log-prob) over the first and the
last 20 steps, its least-squares slope per 100 steps, and `RESULT ...` last. Nothing is asserted."""

import argparse
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def worker(a) -> int:
    from datasets import Dataset

    from dsgrpo import GRPOConfig, GRPOTrainer, dist
    from dsgrpo.testing import tiny_model

    extra = {}
    if a.zero == "3":
        extra["deepspeed"] = {
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
            "optimizer": {"type": "AdamW", "params": {"lr": "auto", "torch_adam": True}},
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto",
        }
    args = GRPOConfig(
        output_dir=os.path.join(a.out, "run"),
        max_steps=a.steps,
        learning_rate=0.0,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=24,
        logging_steps=1,
        gradient_checkpointing=False,
        seed=5,
        report_to="none",
        save_strategy="no",
        vllm_kv_cache_bytes=64 << 20,
        **extra,
    )
    prompts = Dataset.from_list([{"prompt": f"Write the digits of {i * 7919 % 1000}:"} for i in range(64)])
    trainer = GRPOTrainer(
        tiny_model(a.model),
        lambda completions, **k: [float(len(c) % 3) for c in completions],
        args=args,
        train_dataset=prompts,
    )
    trainer.train()
    rows = [h for h in trainer.state.log_history if "sampling/sampling_logp_difference/mean" in h]
    if dist.is_main():
        with open(os.path.join(a.out, "drift.json"), "w") as fh:
            json.dump(
                {
                    "mean": [h["sampling/sampling_logp_difference/mean"] for h in rows],
                    "max": [h["sampling/sampling_logp_difference/max"] for h in rows],
                    "sync_s": [h.get("sync/total_s") for h in rows],
                },
                fh,
            )
    return 0


def slope_per_100(values) -> float:
    n = len(values)
    xs = range(n)
    mx, my = (n - 1) / 2, sum(values) / n
    den = sum((x - mx) ** 2 for x in xs) or 1.0
    return 100 * sum((x - mx) * (y - my) for x, y in zip(xs, values)) / den


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--zero", choices=("auto", "3"), default="3")
    p.add_argument("--model", default="qwen2-tied")
    p.add_argument("--out", default="/tmp/dsgrpo_bench_weight_drift")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        return worker(a)
    from dsgrpo.testing import _free_port

    os.makedirs(a.out, exist_ok=True)
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        PYTHONPATH=REPO,
        DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu"),
    )
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(_free_port()),
        os.path.abspath(__file__),
        "--worker",
        "--steps",
        str(a.steps),
        "--zero",
        a.zero,
        "--model",
        a.model,
        "--out",
        a.out,
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=7200)
    if proc.returncode != 0:
        print(proc.stderr[-4000:])
        return proc.returncode
    r = json.load(open(os.path.join(a.out, "drift.json")))
    mean, worst = r["mean"], r["max"]
    first, last = mean[:20], mean[-20:]
    print(
        f"lr=0, {len(mean)} steps ({'ZeRO-3' if a.zero == '3' else 'deepspeed auto'}, {a.model}, fp32 CPU): "
        f"sampler-trainer |log-prob gap| mean over steps 1-20 {sum(first) / len(first):.3g}, over the last 20 "
        f"{sum(last) / len(last):.3g}; slope {slope_per_100(mean):+.2g} per 100 steps; max over the run "
        f"{max(worst):.3g} (first 20: {max(worst[:20]):.3g}, last 20: {max(worst[-20:]):.3g})"
    )
    syncs = [s for s in r["sync_s"] if s is not None]
    if syncs:
        print(f"sync: {sum(syncs) / len(syncs) * 1000:.1f} ms per sync on average")
    print(
        f"RESULT gap_first20={sum(first) / len(first):.3g} gap_last20={sum(last) / len(last):.3g} "
        f"slope_per_100={slope_per_100(mean):+.2g} max_gap={max(worst):.3g}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
