"""Episodes per second, and the environment's share of a round, for `environment_factory` on 2 CPU ranks.

    .venv/bin/python bench/environments.py [--steps 8] [--out outputs/bench_environments]

A tiny Qwen2 is taught for a few seconds to call tools (the fixture of tests/test_api_dist.py), then GRPOTrainer runs
with a Ledger environment (its `add` keeps a running sum across turns; `explode` raises; `stall` outlives
tool_timeout_s 0.5 s) under torchrun: real vLLM, real DeepSpeed ZeRO-3, fp32. Prints, per round and over the run:
episodes (completions, all turns) per second of the round, tool calls per episode, seconds in tool calls (the
environment's share of the round: sum of env/step_s × calls), and the phases' seconds."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent("""
    import sys
    from datasets import Dataset
    from dsgrpo import GRPOConfig, GRPOTrainer
    from dsgrpo.testing import Ledger  # add keeps a running sum, explode raises, stall outlives the timeout

    model, out, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    prompts = ["What is 2 plus 3?", "Make it explode.", "Wait for me."]
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": prompts[i % 3]}]} for i in range(48)])
    trainer = GRPOTrainer(model, args=GRPOConfig(
        output_dir=out, max_steps=steps, per_device_train_batch_size=8, num_generations=4, learning_rate=1e-4,
        logging_steps=1, max_completion_length=96, temperature=0.3, max_tool_calling_iterations=2,
        tool_timeout_s=0.5, seed=3, vllm_kv_cache_bytes=64 * 2**20, save_steps=10**6, report_to="none",
        deepspeed="ds_configs/zero3.json"), train_dataset=data, environment_factory=Ledger)
    trainer.train()
""")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", default=os.path.join(REPO, "outputs", "bench_environments"))
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    model = os.path.join(args.out, "tool_caller")
    if not os.path.isdir(model):
        sys.path[:0] = [os.path.join(REPO, "tests"), os.path.join(REPO, "tests", "dist_scripts")]
        from test_api_dist import fine_tune_tool_caller

        fine_tune_tool_caller(model)
    script = os.path.join(args.out, "run.py")
    with open(script, "w") as fh:
        fh.write(SCRIPT)
    run = os.path.join(args.out, "run")
    env = dict(
        os.environ,
        PYTHONPATH=REPO,
        OMP_NUM_THREADS="1",
        DS_ACCELERATOR="cpu",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
    )
    subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", script, model, run, str(args.steps)],
        cwd=REPO,
        env=env,
        check=True,
        timeout=1800,
    )
    rows = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl")) if line.strip()]
    rows = [r for r in rows if "reward" in r and "time/generate" in r]
    episodes_per_round = 16  # 2 ranks x 8 completions
    print(f"{'step':>4} {'episodes/s':>10} {'calls/ep':>8} {'tool s':>7} {'env share':>9} {'round s':>7}  phases (s)")
    totals = {"episodes": 0, "seconds": 0.0, "tool": 0.0}
    for r in rows:
        phases = {k[5:]: v for k, v in r.items() if k.startswith("time/") and isinstance(v, (int, float))}
        round_s = sum(
            v
            for k, v in phases.items()
            if k in ("generate", "reward", "reference", "train", "sync", "old_logprobs", "log", "round end")
        )
        tool_s = r["env/step_s"] * r["tools/calls_per_episode"] * episodes_per_round / 2  # per rank: ranks overlap
        totals["episodes"] += episodes_per_round
        totals["seconds"] += round_s
        totals["tool"] += tool_s
        print(
            f"{r['step']:>4} {episodes_per_round / max(round_s, 1e-9):>10.2f} {r['tools/calls_per_episode']:>8.2f} "
            f"{tool_s:>7.2f} {tool_s / max(round_s, 1e-9):>9.1%} {round_s:>7.2f}  "
            + " ".join(f"{k} {v:.2f}" for k, v in sorted(phases.items()))
        )
    print(
        f"over {len(rows)} rounds: {totals['episodes'] / totals['seconds']:.2f} episodes/s, the environment's "
        f"tool calls {totals['tool'] / totals['seconds']:.1%} of the rounds' time"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
