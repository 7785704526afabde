"""Throughput of GRPO steps: seconds per step and completion tokens per second, with the time breakdown.

    python -m dsgrpo.testing make --hidden 512 --layers 8 --heads 8 --vocab 1000 --out /tmp/m32    # (a) ≈35M
    torchrun --nproc_per_node 2 bench/throughput.py --model /tmp/m32 --steps 6 --num-generations 8 \\
        --max-completion-length 128 --batch-size 32 --parts

A synthetic prompt set, one rule reward (digit fraction), sampling at temperature 1.0, fp32. --batch-size is
completions per optimizer step over all ranks. The last line is
`RESULT sec_per_step=<mean over steps 2..N> completion_tok_per_s=<...>`. With --parts, each part is then
measured alone on the same batch (generation, the policy's forward+backward+step, gather + reload) so the
step's overhead over the sum of its parts can be read off.
"""

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def digit_fraction(prompts, completions, **kwargs):
    return [sum(ch.isdigit() for ch in c) / max(1, len(c)) for c in completions]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--num-generations", type=int, default=8)
    p.add_argument("--max-completion-length", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=32, help="completions per optimizer step, all ranks")
    p.add_argument("--hf-generate", action="store_true", help="use the HF generate backend instead of vLLM")
    p.add_argument("--deepspeed", default="zero3.json")
    p.add_argument("--parts", action="store_true", help="also time each part of a step alone")
    a = p.parse_args()

    import torch
    from datasets import Dataset

    from dsgrpo import GRPOConfig, GRPOTrainer, dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    prompts = Dataset.from_list([{"prompt": f"Count from {i} and keep going:"} for i in range(512)])
    args = GRPOConfig(output_dir=tempfile.mkdtemp(prefix="dsgrpo-bench-"), max_steps=a.steps,
                      per_device_train_batch_size=a.batch_size // world, num_generations=a.num_generations,
                      max_completion_length=a.max_completion_length, temperature=1.0, learning_rate=1e-6,
                      gradient_checkpointing=False, logging_steps=1, bf16=False, use_vllm=not a.hf_generate,
                      deepspeed=a.deepspeed, vllm_kv_cache_bytes=256 * 2**20)
    stamps = []

    class Clock:
        def on_step_end(self, args, state, control, **kw):
            stamps.append(time.perf_counter())

    trainer = GRPOTrainer(a.model, digit_fraction, args=args, train_dataset=prompts, callbacks=[Clock()])
    start = time.perf_counter()
    trainer.train()
    history = trainer.state.log_history
    steps = [t1 - t0 for t0, t1 in zip([start] + stamps[:-1], stamps)][1:]  # steps 2..N
    tokens = [h["completions/mean_length"] * a.batch_size for h in history][1:]
    sec = sum(steps) / len(steps)
    tok_s = sum(tokens) / sum(steps)
    if dist.is_main():
        n_params = sum(getattr(q, "ds_numel", q.numel()) for q in trainer.policy.module.parameters())
        print(f"model {a.model}: {n_params / 1e6:.1f}M parameters, world {world}, "
              f"{'hf' if a.hf_generate else 'vllm'} generation, {a.batch_size} completions/step")
        for key in ("time/generate", "time/reward", "time/reference", "time/train", "time/sync"):
            vals = [h[key] for h in history[1:]]
            print(f"  {key:16s} {sum(vals) / len(vals):8.3f} s")
        print(f"  mean completion length {sum(h['completions/mean_length'] for h in history[1:]) / len(history[1:]):.1f}")
    if a.parts:
        parts = time_parts(trainer, a)
        if dist.is_main():
            total = sum(parts.values())
            print("parts alone: " + ", ".join(f"{k} {v:.3f} s" for k, v in parts.items()) +
                  f"; sum {total:.3f} s; step / sum = {sec / total:.2f}")
    if dist.is_main():
        print(f"RESULT sec_per_step={sec:.3f} completion_tok_per_s={tok_s:.1f}")
    return 0


def time_parts(trainer, a, reps: int = 2):
    """Each part of a step alone, on the same shapes: generation, update (forward+backward+step), sync."""
    import torch

    from dsgrpo import dist
    from dsgrpo.rollout import sync_weights

    trainer.state.max_steps = trainer.state.global_step + 2 * reps  # room for the updates timed below
    source = trainer.train_prompts
    share = source.rank_slice(source.round_prompts(0, trainer.prompts_per_round, 0, False), a.num_generations,
                              dist.rank(), dist.world_size())
    ids = [source.prompt_ids[i] for i in share.indices]
    out = {}
    t = time.perf_counter()
    for _ in range(reps):
        rollout = trainer.generator.generate(ids, share.counts, trainer.sampling)
    out["generate"] = (time.perf_counter() - t) / reps
    batch = trainer._sample(source, 0, a.num_generations)
    adv = torch.randn(len(batch.rollout))
    t = time.perf_counter()
    for _ in range(reps):
        trainer._update(batch, adv, None, None)
    out["update"] = (time.perf_counter() - t) / reps
    t = time.perf_counter()
    for _ in range(reps):
        sync_weights(trainer.policy.module, trainer.generator, trainer.args.weight_sync_bucket_bytes, trainer.tied)
    out["sync"] = (time.perf_counter() - t) / reps
    del rollout
    return out


if __name__ == "__main__":
    sys.exit(main())
