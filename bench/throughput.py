"""Throughput of GRPO steps: seconds per step and completion tokens per second, with the time breakdown.

    python -m dsgrpo.testing make --hidden 512 --layers 8 --heads 8 --vocab 1000 --out /tmp/m32    # (a) ≈35M
    torchrun --nproc_per_node 2 bench/throughput.py --model /tmp/m32 --steps 6 --num-generations 8 \\
        --max-completion-length 128 --batch-size 32 --parts

A synthetic prompt set, one rule reward (digit fraction), sampling at temperature 1.0, fp32. --batch-size is
completions per optimizer step over all ranks. The last line is
`RESULT sec_per_step=<mean over steps 2..N> completion_tok_per_s=<...>`. With --parts, each part is then
measured alone on the same batch (generation, the policy's forward+backward+step, gather + reload) so the
step's overhead over the sum of its parts can be read off.

Asynchronous trainer (issue 8), beside the synchronous run on the same workload:

    torchrun --nproc_per_node 2 bench/throughput.py --model M ... --async [--placement split] [--max-staleness 1]
    ... --slow-reward 0.2     the reward sleeps 0.2 s per call (a remote reward model's latency)
    ... --skew 0.02           rank 1's rollouts of every 4th prompt cost an extra 0.02 s per completion token
                              (a few prompts with very long completions, landing on one rank)

Long-tailed completion lengths (issue 27), packed against padded micro-batches and TRL on the same workload:

    python -m dsgrpo.testing make --hidden 256 --layers 4 --heads 4 --out /tmp/m_lt
    python bench/throughput.py --model /tmp/m_lt --steps 6 --num-generations 8 --max-completion-length 512 \
        --batch-size 16 --stop-ids 13 --token-budget none      # packed; 0: padded
    python bench/trl_throughput.py --model /tmp/m_lt ... --stop-ids 13
    python bench/throughput.py --model /tmp/m_lt ... --max-completion-length 81 --fixed-length   # same real tokens
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
    p.add_argument(
        "--deepspeed",
        default="auto",
        help="'auto' (dsgrpo's default: ZeRO-2 where the memory plan "
        "fits whole weights, else ZeRO-3), or a file in ds_configs/",
    )
    p.add_argument("--parts", action="store_true", help="also time each part of a step alone")
    p.add_argument("--async", dest="use_async", action="store_true", help="AsyncGRPOTrainer instead of GRPOTrainer")
    p.add_argument("--placement", default="colocate", choices=["colocate", "split"])
    p.add_argument("--max-staleness", type=int, default=1)
    p.add_argument("--no-balancing", action="store_true")
    p.add_argument(
        "--gradient-checkpointing",
        default="false",
        choices=["auto", "true", "false"],
        help="GRPOConfig.gradient_checkpointing (TRL's default is true)",
    )
    p.add_argument(
        "--vllm-enforce-eager",
        default="auto",
        choices=["auto", "true", "false"],
        help="GRPOConfig.vllm_enforce_eager (auto: compiled when the run is long enough on CPU)",
    )
    p.add_argument("--chunk-groups", type=int, default=None, help="async_chunk_groups (None: the trainer's default)")
    p.add_argument("--slow-reward", type=float, default=0.0, help="seconds the reward sleeps per call")
    p.add_argument("--skew", type=float, default=0.0, help="extra seconds per token for every 4th prompt on rank 1")
    p.add_argument(
        "--stop-ids",
        type=int,
        default=0,
        help="long-tailed lengths: generation also stops at this many "
        "token ids (a random model then makes completions of 1..max-completion-length tokens, most short)",
    )
    p.add_argument(
        "--fixed-length",
        action="store_true",
        help="every completion runs to --max-completion-length "
        "(vLLM's ignore_eos): the fixed-length reference for --stop-ids runs",
    )
    p.add_argument("--partial-rollout", action="store_true", help="partial_rollout=True (issue 46)")
    p.add_argument("--overprovision", type=int, default=0, help="rollout_overprovision (groups beyond a round)")
    p.add_argument(
        "--token-budget",
        default="",
        help="token_budget: N tokens, 'none' (planned: one padded "
        "micro-batch's worth) or 0 (padded micro-batches); unset: dsgrpo's default",
    )
    a = p.parse_args()

    from datasets import Dataset

    from dsgrpo import AsyncGRPOTrainer, GRPOConfig, GRPOTrainer, dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    trainers = world - world // 2 if a.placement == "split" else world

    def reward(prompts, completions, **kw):
        if a.slow_reward:
            time.sleep(a.slow_reward)
        return digit_fraction(prompts, completions)

    prompts = Dataset.from_list([{"prompt": f"Count from {i} and keep going:"} for i in range(512)])
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="dsgrpo-bench-"),
        max_steps=a.steps,
        per_device_train_batch_size=a.batch_size // trainers,
        num_generations=a.num_generations,
        max_completion_length=a.max_completion_length,
        temperature=1.0,
        learning_rate=1e-6,
        gradient_checkpointing={"true": True, "false": False}.get(a.gradient_checkpointing, "auto"),
        logging_steps=1,
        bf16=False,
        use_vllm=not a.hf_generate,
        deepspeed=a.deepspeed,
        vllm_kv_cache_bytes=256 * 2**20,
        async_placement=a.placement,
        max_staleness=a.max_staleness,
        async_load_balancing=not a.no_balancing,
        async_chunk_groups=a.chunk_groups,
        partial_rollout=a.partial_rollout,
        rollout_overprovision=a.overprovision,
        vllm_enforce_eager={"true": True, "false": False}.get(a.vllm_enforce_eager),
        generation_kwargs={
            **long_tail_kwargs(a.stop_ids, hf=a.hf_generate),
            **({"ignore_eos": True} if a.fixed_length else {}),
        },
        **(
            {}
            if a.token_budget == ""
            else {"token_budget": None if a.token_budget.lower() == "none" else int(a.token_budget)}
        ),
    )
    stamps = []

    class Clock:
        def on_step_end(self, args, state, control, **kw):
            stamps.append(time.perf_counter())

    cls = AsyncGRPOTrainer if a.use_async else GRPOTrainer
    trainer = cls(a.model, reward, args=args, train_dataset=prompts, callbacks=[Clock()])
    if a.skew and trainer.generator is not None:
        skew_generation(trainer, a.skew)
    if not getattr(trainer, "trains", True):  # a generating rank in split placement: it only follows
        trainer.train()
        return 0
    start = time.perf_counter()
    trainer.train()
    history = [h for h in trainer.state.log_history if "completions/mean_length" in h]  # not the summary row
    steps = [t1 - t0 for t0, t1 in zip([start] + stamps[:-1], stamps)][1:]  # steps 2..N
    tokens = [h["completions/mean_length"] * a.batch_size for h in history][1:]
    sec = sum(steps) / len(steps)
    tok_s = sum(tokens) / sum(steps)
    if dist.is_main():
        n_params = sum(getattr(q, "ds_numel", q.numel()) for q in trainer.policy.module.parameters())
        mode = (
            f"async {a.placement} (max_staleness {a.max_staleness}, balancing {not a.no_balancing})"
            if a.use_async
            else "sync"
        )
        if a.partial_rollout:
            mode += f", partial rollouts (overprovision {a.overprovision}, max_staleness {a.max_staleness})"
        print(
            f"model {a.model}: {n_params / 1e6:.1f}M parameters, world {world}, {mode}, "
            f"{'hf' if a.hf_generate else 'vllm'} generation, {a.batch_size} completions/step, "
            f"slow reward {a.slow_reward} s, skew {a.skew} s/token"
        )
        keys = (
            "time/generate",
            "time/reward",
            "time/reference",
            "time/train",
            "time/sync",
            "time/wait_for_rollout",
            "time/wait_for_weights",
            "async/staleness/mean",
            "async/groups_stolen",
            "partial/staleness/0",
            "partial/staleness/1",
            "partial/staleness/2",
            "partial/mixed_version_completions",
            "sampling/token_band_masked",
            "partial/sampler_gap/age0",
            "partial/sampler_gap/age1",
            "partial/sampler_gap/age2+",
            "partial/completions_stopped",
            "partial/completions_resampled",
            "partial/tokens_discarded",
            "partial/overprovisioned",
        )
        for key in keys:
            vals = [h[key] for h in history[1:] if key in h]
            if vals:
                print(f"  {key:22s} {sum(vals) / len(vals):8.3f}")
        ranks = sorted(k for k in history[-1] if k.startswith("async/completions_generated/"))
        if ranks:
            print("  completions generated: " + ", ".join(f"{k.split('/')[-1]} {history[-1][k]:.0f}" for k in ranks))
        print(
            f"  mean completion length {sum(h['completions/mean_length'] for h in history[1:]) / len(history[1:]):.1f}"
        )
        train = [h["time/train"] for h in history[1:] if "time/train" in h]
        if train:  # the training side's price of a real token (packing's measure, issue 27)
            print(f"  train s per completion token {sum(train) / sum(tokens[: len(train)]):.3e}")
        peaks = [h["memory/peak_gib/train"] for h in history[1:] if "memory/peak_gib/train" in h]
        rises = [h["memory/rise_gib/train"] for h in history[1:] if "memory/rise_gib/train" in h]
        if peaks:
            print(
                f"  train phase peak {max(peaks):.3f} GiB"
                + (f", {max(rises):.3f} GiB above its start" if rises else "")
            )
    if a.parts:
        parts = time_parts(trainer, a)
        if dist.is_main():
            total = sum(parts.values())
            print(
                "parts alone: "
                + ", ".join(f"{k} {v:.3f} s" for k, v in parts.items())
                + f"; sum {total:.3f} s; step / sum = {sec / total:.2f}"
            )
    if dist.is_main():
        print(f"RESULT sec_per_step={sec:.3f} completion_tok_per_s={tok_s:.1f}")
    return 0


def stop_ids(n: int) -> list:
    """The token ids generation stops at for --stop-ids n (ids 100.. of the tiny models' 1,024; none special)."""
    return list(range(100, 100 + n))


def long_tail_kwargs(n: int, hf: bool) -> dict:
    """generation_kwargs that make a random model stop at n more ids: vLLM's stop_token_ids, transformers' eos list."""
    if not n:
        return {}
    return {"eos_token_id": stop_ids(n)} if hf else {"stop_token_ids": stop_ids(n)}


def skew_generation(trainer, seconds_per_token: float) -> None:
    """Rank 1 pays `seconds_per_token` extra for every completion token of every 4th prompt: the cost of a few
    prompts whose completions are much longer, concentrated on one rank."""
    from dsgrpo import dist

    if dist.rank(dist.EVERYONE) != 1:
        return
    generate = trainer.generator.generate
    long_prompts = {tuple(ids) for i, ids in enumerate(trainer.train_prompts.prompt_ids) if i % 4 == 0}

    def slowed(prompt_ids, counts, sampling, seeds=None):
        rollout = generate(prompt_ids, counts, sampling, seeds=seeds)
        extra = sum(len(c) for p, c in zip(rollout.prompt_ids, rollout.completion_ids) if tuple(p) in long_prompts)
        time.sleep(extra * seconds_per_token)
        return rollout

    trainer.generator.generate = slowed


def time_parts(trainer, a, reps: int = 2):
    """Each part of a step alone, on the same shapes: generation, update (forward+backward+step), sync."""
    import torch

    from dsgrpo import dist
    from dsgrpo.trl_surface import generation_batch_rows

    trainer.state.max_steps = trainer.state.global_step + 2 * reps  # room for the updates timed below
    source = trainer.train_prompts
    share = source.rank_slice(
        source.round_prompts(0, trainer.prompts_per_round, 0, False), a.num_generations, dist.rank(), dist.world_size()
    )
    ids = [source.prompt_ids[i] for i in share.indices]
    out = {}
    t = time.perf_counter()
    for _ in range(reps):
        rollout = trainer.generator.generate(ids, share.counts, trainer.sampling)
    out["generate"] = (time.perf_counter() - t) / reps
    batch = trainer.source.next_batch(trainer.state.generation_round)  # the trainer's own round (collective)
    adv = torch.randn(len(batch.rollout))
    rows = generation_batch_rows(batch)
    t = time.perf_counter()
    for _ in range(reps):
        trainer.update.run(
            batch.micro,
            batch.rollout.truncated,
            adv,
            None,
            None,
            micro_step=lambda: trainer.training_step(trainer.model, rows),
        )
    out["update"] = (time.perf_counter() - t) / reps
    t = time.perf_counter()
    for _ in range(reps):
        trainer.weight_sync(trainer.policy.module, trainer.generator)
    out["sync"] = (time.perf_counter() - t) / reps
    del rollout
    return out


if __name__ == "__main__":
    sys.exit(main())
