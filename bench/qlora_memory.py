"""QLoRA's memory (issue 67): the same 2-rank LoRA run on a full-precision base and on its 4-bit and 8-bit
quantisations, each rank's measured peak resident set beside the memory planner's figures (policy weights, peak).
The model is a random-init Qwen2 of a real width (hidden 768, 12 layers: 113 M parameters, 94% of them in the
decoder's linear layers) on the local tokenizer; nothing is downloaded.

    .venv/bin/python bench/qlora_memory.py [--steps 2] [--zero 3]

Prints a table and `RESULT qlora_4bit_peak_mb=... full_peak_mb=...` last."""

import argparse
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

MODES = {
    "LoRA, fp32 base": None,
    "QLoRA, 8-bit base": {"load_in_8bit": True},
    "QLoRA, 4-bit nf4 base": {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True},
}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--zero", type=int, default=3, choices=(2, 3))
    parser.add_argument("--out", default=os.path.join(REPO, "outputs", "bench", "qlora_memory"))
    a = parser.parse_args()
    from dsgrpo.testing import save_custom_model

    base = os.path.join(a.out, "base")
    if not os.path.exists(os.path.join(base, "config.json")):
        save_custom_model(base, hidden_size=768, num_hidden_layers=12, num_attention_heads=12)
    rows = []
    for name, quantization in MODES.items():
        run = os.path.join(a.out, name.split(",")[1].strip().split()[0].replace("-", ""))
        config = {
            "model": base,
            "train_dataset": "task:copy_digits",
            "reward_funcs": ["dsgrpo.tasks:copy_digits_reward"],
            "peft_config": {"r": 16, "lora_alpha": 32, "target_modules": "all-linear"},
            "output_dir": run,
            "max_steps": a.steps,
            "per_device_train_batch_size": 8,
            "num_generations": 4,
            "max_completion_length": 8,
            "deepspeed": f"zero{a.zero}.json",
            "vllm_kv_cache_bytes": 256 * 2**20,
            "gradient_checkpointing": False,
            "logging_steps": 1,
            "report_to": [],
        }
        if quantization:
            config["quantization_config"] = quantization
        path = run + ".yaml"
        os.makedirs(a.out, exist_ok=True)
        with open(path, "w") as fh:
            json.dump(config, fh)  # JSON is YAML
        env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "-m",
            "dsgrpo.cli",
            "train",
            path,
        ]
        start = time.perf_counter()
        done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        seconds = time.perf_counter() - start
        if done.returncode:
            print(done.stdout[-2000:], done.stderr[-4000:])
            raise SystemExit(f"{name}: exited {done.returncode}")
        memory = json.load(open(os.path.join(run, "memory.json")))
        plan = memory["plan"]
        rows.append(
            (
                name,
                [b / 2**20 for b in memory["measured_peak_bytes_per_rank"]],
                plan["parts"]["policy/parameters"] / 2**20,
                plan["peak_bytes_per_device"] / 2**20,
                seconds,
            )
        )
    print(f"\nZeRO-{a.zero}, 2 CPU ranks, {a.steps} steps, LoRA r=16 on every linear layer, fp32 compute")
    print(
        "| base | measured peak RSS per rank (MiB) | planned policy weights per rank (MiB) | planned peak (MiB) | s |"
    )
    print("|---|---|---|---|---|")
    for name, peaks, weights, peak, seconds in rows:
        print(f"| {name} | {' / '.join(f'{p:.0f}' for p in peaks)} | {weights:.1f} | {peak:.0f} | {seconds:.0f} |")
    full, four = max(rows[0][1]), max(rows[2][1])
    print(f"RESULT qlora_4bit_peak_mb={four:.0f} full_peak_mb={full:.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
