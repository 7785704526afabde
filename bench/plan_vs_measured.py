"""The memory planner against measured peaks: each config is trained for a few steps on 2 CPU ranks with the
deepspeed launcher (`dsgrpo train`), and its memory.json (written by the trainer at the end: every rank's peak
resident memory, and the plan the trainer made at start-up) is compared.

    python bench/plan_vs_measured.py [--configs demo,w1,qwen0.5b] [--root /tmp/dsgrpo-plan-bench]

  demo      examples/cpu_demo.yaml (the tiny Qwen2), 10 steps
  w1        a random Qwen2 of hidden 512 × 8 layers (vocab 1000), G=8, 128-token completions, 16 a rank a step
  qwen0.5b  Qwen2.5-0.5B's shape (random weights, bf16: fp32 does not fit twice in 24 GiB, 151,936-token
            vocabulary), ZeRO-3 over 2 ranks

Prints one line per config and `RESULT <config>_error_pct=...` last (planned / measured - 1 of the largest rank).
Nothing is asserted: the figures go in notes and issues."""

import argparse
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

COMMON = ["--logging_steps", "1", "--save_strategy", "no", "--report_to", "none", "--memory_check", "warn"]


def model_for(config: str, root: str) -> str:
    if config == "demo":
        from dsgrpo.testing import tiny_model

        init = os.path.join(REPO, "outputs", "demo", "init_model")
        return init if os.path.isdir(init) else tiny_model("qwen2")
    if config == "w1":
        path = os.path.join(root, "w1-model")
        if not os.path.isdir(path):
            from dsgrpo.testing import save_custom_model

            save_custom_model(path, hidden_size=512, num_hidden_layers=8, num_attention_heads=8, vocab_size=1000)
        return path
    from bench.weight_sync import build_model

    return build_model("qwen2.5-0.5b", root)


def overrides(config: str) -> list:
    if config == "demo":
        return ["--max_steps", "10"]
    if config == "w1":
        return [
            "--max_steps",
            "3",
            "--num_generations",
            "8",
            "--max_completion_length",
            "128",
            "--per_device_train_batch_size",
            "16",
            "--vllm_kv_cache_bytes",
            str(256 * 2**20),
            "--learning_rate",
            "1e-6",
        ]
    return [
        "--max_steps",
        "2",
        "--num_generations",
        "4",
        "--max_completion_length",
        "32",
        "--bf16",
        "true",
        "--per_device_train_batch_size",
        "4",
        "--vllm_kv_cache_bytes",
        str(256 * 2**20),
        "--learning_rate",
        "1e-6",
        "--vllm_max_model_length",
        "512",
    ]


def run(config: str, root: str) -> dict:
    out = os.path.join(root, f"run-{config}")
    cmd = [
        sys.executable,
        "-m",
        "deepspeed.launcher.runner",
        "--num_gpus",
        "2",
        "--master_port",
        "29631",
        "--module",
        "dsgrpo.train",
        os.path.join(REPO, "examples", "cpu_demo.yaml"),
        "--model",
        model_for(config, root),
        "--output_dir",
        out,
        *COMMON,
        *overrides(config),
    ]
    # DSGRPO_TRIM_HEAP=1: the plan is of live memory; a run whose plan leaves room would otherwise skip the heap trims
    # that make the resident peak follow it (device.choose_heap_trimming)
    env = dict(
        os.environ,
        DS_ACCELERATOR="cpu",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        TOKENIZERS_PARALLELISM="false",
        DSGRPO_TRIM_HEAP="1",
    )
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=3600)
    with open(out + ".log", "w") as fh:
        fh.write(proc.stdout + proc.stderr)
    if proc.returncode:
        print(proc.stdout[-4000:], proc.stderr[-4000:])
        raise SystemExit(f"{config}: training failed (exit {proc.returncode})")
    with open(os.path.join(out, "memory.json")) as fh:
        return json.load(fh)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--configs", default="demo,w1,qwen0.5b")
    p.add_argument("--root", default="/tmp/dsgrpo-plan-bench")
    a = p.parse_args()
    os.makedirs(a.root, exist_ok=True)
    errors = {}
    for config in a.configs.split(","):
        memory = run(config, a.root)
        measured = max(memory["measured_peak_bytes_per_rank"])
        planned = memory["plan"]["peak_bytes_per_device"]
        errors[config] = 100.0 * (planned / measured - 1)
        parts = ", ".join(f"{k} {v / 2**20:.0f}" for k, v in memory["plan"]["parts"].items() if v)
        print(
            f"{config:9s} planned {planned / 2**30:6.2f} GiB  measured {measured / 2**30:6.2f} GiB "
            f"(ranks: {', '.join(f'{m / 2**30:.2f}' for m in memory['measured_peak_bytes_per_rank'])})  "
            f"error {errors[config]:+.1f}%\n          parts (MiB): {parts}",
            flush=True,
        )
    print("RESULT " + " ".join(f"{k}_error_pct={v:+.1f}" for k, v in errors.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
