"""Issue 16's GPU figures, in one process on one device (bench/gpu_check.sh runs it on a lent GPU machine, which has
no vLLM: generation uses the policy's own HF generate):

  1. GRPO steps of a Qwen2.5-0.5B-shaped model (random weights, the local tokenizer) under DeepSpeed ZeRO-3 in bf16:
     the measured peak (torch.cuda.max_memory_allocated, per phase and overall, from the run's memory.json and
     metrics.jsonl) against the planner's plan made at start-up;
  2. bench/logprob_memory.py: the chunked log-prob's peak against the full [B, T, V] logits'.

    python bench/gpu_check.py --out DIR [--steps 3] [--batch 16] [--completion 256]
    python bench/gpu_check.py --out /tmp/gc --tiny      # a smoke test of the same path on CPU (the tiny Qwen2)

Prints `RESULT ...` lines; nothing is asserted."""

import argparse
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def run_steps(a) -> dict:
    if a.tiny:
        from dsgrpo.testing import tiny_model

        model = tiny_model("qwen2")
    else:
        from bench.weight_sync import build_model

        model = build_model("qwen2.5-0.5b", os.path.join(a.out, "models"))
    out = os.path.join(a.out, "run")
    cmd = [
        sys.executable,
        "-m",
        "dsgrpo.train",
        os.path.join(REPO, "examples", "cpu_demo.yaml"),
        "--model",
        model,
        "--output_dir",
        out,
        "--use_vllm",
        "false",
        "--bf16",
        "true",
        "--max_steps",
        str(a.steps),
        "--per_device_train_batch_size",
        str(a.batch),
        "--num_generations",
        "4",
        "--max_completion_length",
        str(a.completion),
        "--learning_rate",
        "1e-6",
        "--logging_steps",
        "1",
        "--save_strategy",
        "no",
        "--report_to",
        "none",
        "--memory_check",
        "warn",
        "--gradient_checkpointing",
        "auto",
    ]
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    if a.tiny:
        env["DS_ACCELERATOR"] = "cpu"
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=a.timeout)
    seconds = time.perf_counter() - start
    with open(os.path.join(a.out, "steps.log"), "w") as fh:
        fh.write(proc.stdout + proc.stderr)
    if proc.returncode:
        print(proc.stdout[-3000:], proc.stderr[-5000:])
        raise SystemExit(f"the GRPO steps failed (exit {proc.returncode}); log: {a.out}/steps.log")
    plan_lines = [
        line
        for line in proc.stdout.splitlines() + proc.stderr.splitlines()
        if line.startswith(("memory plan", "  ", "verdict"))
    ]
    print("\n".join(plan_lines[:40]))
    with open(os.path.join(out, "memory.json")) as fh:
        memory = json.load(fh)
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    phase_peaks = {}
    for row in rows:
        for key, value in row.items():
            if key.startswith("memory/peak_gib/"):
                phase = key.rsplit("/", 1)[-1]
                phase_peaks[phase] = max(phase_peaks.get(phase, 0.0), value)
    step_times = [sum(v for k, v in r.items() if k.startswith("time/")) for r in rows if "reward" in r]
    return {"memory": memory, "phase_peaks_gib": phase_peaks, "seconds": seconds, "step_seconds": step_times}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch", type=int, default=16, help="completions a step")
    p.add_argument("--completion", type=int, default=256)
    p.add_argument("--tiny", action="store_true", help="the tiny Qwen2 on CPU: a smoke test of this script")
    p.add_argument("--timeout", type=int, default=300, help="seconds for the GRPO steps")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    import torch

    print(
        f"torch {torch.__version__}, cuda {torch.cuda.is_available()}"
        + (f" ({torch.cuda.get_device_name(0)})" if torch.cuda.is_available() else ""),
        flush=True,
    )

    got = run_steps(a)
    memory = got["memory"]
    measured = max(memory["measured_peak_bytes_per_rank"])
    planned = memory["plan"]["peak_bytes_per_device"]
    planned_phases = {k: v / 2**30 for k, v in memory["plan"].get("phase_peaks", {}).items()}
    print(f"planned phases (GiB): {json.dumps({k: round(v, 2) for k, v in planned_phases.items()})}")
    print(f"measured phases (GiB): {json.dumps({k: round(v, 2) for k, v in got['phase_peaks_gib'].items()})}")
    print(f"step seconds: {[round(s, 2) for s in got['step_seconds']]} (whole run {got['seconds']:.0f} s)")
    print(
        f"RESULT zero3_bf16_step planned_gib={planned / 2**30:.2f} measured_gib={measured / 2**30:.2f} "
        f"error_pct={100 * (planned / measured - 1):+.1f}",
        flush=True,
    )
    with open(os.path.join(a.out, "gpu_check.json"), "w") as fh:
        json.dump(got, fh, indent=1)

    if a.tiny:
        return 0
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "bench", "logprob_memory.py"), "--rows", "8", "--completion", "1024"],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=REPO,
    )
    print(proc.stdout[-2000:], proc.stderr[-2000:] if proc.returncode else "", flush=True)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
