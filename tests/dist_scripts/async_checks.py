"""Run under `torchrun --nproc_per_node 2`: AsyncGRPOTrainer on real DeepSpeed ZeRO-3 and real in-process vLLM,
fp32 on CPU. Each check records numbers in OUT_DIR/result-<rank>.json; tests/test_async_dist.py asserts on them.

Usage: torchrun --nproc_per_node 2 tests/dist_scripts/async_checks.py OUT_DIR
"""

import faulthandler
import json
import os
import signal
import sys
import time

from datasets import Dataset

from dsgrpo import AsyncGRPOTrainer, GRPOTrainer, dist
from dsgrpo.engines.weights import named_full_parameters
from dsgrpo.testing import tiny_model
from recorder import check_config
from recorder import SHARDED_ZERO3, digit_fraction, recorder, rollout_worker, training_rows, watch_split_versions

faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>` shows where a hang is
OUT = sys.argv[1]
ONLY = set(sys.argv[2].split(",")) if len(sys.argv) > 2 else None
results = {}


check = recorder(results, ONLY)


prompts = Dataset.from_list([{"prompt": f"Write some numbers {i}:", "idx": i} for i in range(64)])
DS = SHARDED_ZERO3


config = check_config(
    OUT, max_steps=4, max_completion_length=12, learning_rate=2e-3, seed=1, deepspeed=DS, vllm_kv_cache_bytes=64 * 2**20
)


def full_weights(trainer):
    return {n: t.clone() for n, t in named_full_parameters(trainer.policy.module, 1 << 30)}


def record_plans(trainer):
    """Wrap the batch cut to keep, per round, (version, position, holder, trainer rank) of every trained group."""
    plans = []
    original = trainer.source.next_batch

    def wrapped(round_index):
        out = original(round_index)
        plan = trainer.source.last_plan
        plans.append({"round": round_index, "groups": [[v, p, r, plan.destination[p]] for v, p, r in plan.chosen]})
        return out

    trainer.source.next_batch = wrapped
    return plans


KEEP = []


def teardown(trainer):
    """Several trainers share this process: stop a trainer's worker before the next one starts, and keep the
    trainer referenced: a collected vLLM engine tears down process groups DeepSpeed still uses."""
    KEEP.append(trainer)
    worker = rollout_worker(trainer) if isinstance(trainer, AsyncGRPOTrainer) else None
    if worker is not None:
        worker.shutdown()


rank = None


# ------------------------------------------------------------------ 1. max_staleness=0, no balancing == GRPOTrainer
@check("equivalence")
def _():
    global rank
    sync = GRPOTrainer(tiny_model("qwen2"), digit_fraction, args=config("sync"), train_dataset=prompts)
    rank = dist.rank()
    initial = full_weights(sync)
    sync.train()
    w_sync = full_weights(sync)
    sync_rewards = [h["reward"] for h in training_rows(sync)]
    teardown(sync)
    asyn = AsyncGRPOTrainer(
        tiny_model("qwen2"),
        digit_fraction,
        train_dataset=prompts,
        args=config("async_equiv", max_staleness=0, async_load_balancing=False, async_chunk_groups=2),
    )
    plans = record_plans(asyn)
    asyn.train()
    w_async = full_weights(asyn)
    async_rewards = [h["reward"] for h in training_rows(asyn)]
    teardown(asyn)
    moved = max((w_sync[n] - initial[n]).abs().max().item() for n in initial)
    diff = max((w_sync[n] - w_async[n]).abs().max().item() for n in initial)
    return {
        "max_weight_diff": diff,
        "weights_moved": moved,
        "sync_rewards": sync_rewards,
        "async_rewards": async_rewards,
        "plans": plans,
    }


# ------------------------------------------------------------------ 2. a straggler rank: balancing on vs off
def slow_on_rank1(prompts, completions, **kwargs):
    if dist.rank() == 1:
        time.sleep(0.4)  # a slow reward service on one rank: its rollout worker falls behind
    return digit_fraction(prompts, completions)


def straggler_run(name, balanced):
    trainer = AsyncGRPOTrainer(
        tiny_model("qwen2"),
        slow_on_rank1,
        train_dataset=prompts,
        args=config(
            name,
            max_steps=6,
            max_staleness=1,
            async_load_balancing=balanced,
            async_chunk_groups=1,
            per_device_train_batch_size=16,
            learning_rate=5e-4,
        ),
    )
    plans = record_plans(trainer)
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    history = training_rows(trainer)
    teardown(trainer)
    return {"wall_s": wall, "plans": plans, "history": history}


@check("straggler")
def _():
    return {"balanced": straggler_run("straggler_balanced", True), "fixed": straggler_run("straggler_fixed", False)}


# ------------------------------------------------------------------ 3. dynamic sampling (DAPO): zero-std groups dropped
seen_groups = []


def half_constant(prompts, completions, idx, **kwargs):
    """Prompts with idx % 2 == 0 get one reward for every completion (zero std): useless to GRPO."""
    return [1.0 if i % 2 == 0 else d for i, d in zip(idx, digit_fraction(prompts, completions))]


@check("dynamic_sampling")
def _():
    trainer = AsyncGRPOTrainer(
        tiny_model("qwen2"),
        half_constant,
        train_dataset=prompts,
        args=config("dynamic", max_steps=3, drop_zero_std_groups=True, max_staleness=1),
    )
    original = trainer._score

    def spy(batch, group):
        seen_groups.append(
            {
                "rows": len(batch.rollout),
                "std": batch.rewards.view(-1, group).std(dim=1).tolist(),
                "idx": batch.columns["idx"][::group],
            }
        )
        return original(batch, group)

    trainer._score = spy
    trainer.train()
    history = training_rows(trainer)
    teardown(trainer)
    return {"seen": seen_groups, "history": history}


# ------------------------------------------------------------------ 4. checkpoint with a non-empty pool, then resume
@check("resume")
def _():
    first = AsyncGRPOTrainer(
        tiny_model("qwen2"),
        digit_fraction,
        train_dataset=prompts,
        args=config("resume", max_steps=2, max_staleness=1, save_steps=2, async_chunk_groups=1),
    )
    plans_a = record_plans(first)
    first.train()
    teardown(first)
    ckpt = os.path.join(OUT, "resume", "checkpoint-2")
    saved = json.load(open(os.path.join(ckpt, f"rollout_state_{dist.rank()}.json")))
    second = AsyncGRPOTrainer(
        tiny_model("qwen2"),
        digit_fraction,
        train_dataset=prompts,
        args=config(
            "resume", max_steps=4, max_staleness=1, save_steps=10**6, async_chunk_groups=1, resume_from_checkpoint=ckpt
        ),
    )
    plans_b = record_plans(second)
    second.train()
    teardown(second)
    return {
        "plans_a": plans_a,
        "plans_b": plans_b,
        "saved_pool": [g["position"] for g in saved["pool"]],
        "saved_versions": [g["version"] for g in saved["pool"]],
        "claimed": saved["claimed"],
    }


# ------------------------------------------------------------------ 5. learning, one step off-policy
@check("learning")
def _():
    """The same 40 steps with the synchronous trainer and the asynchronous one (one version stale)."""
    steps = int(os.environ.get("LEARN_STEPS", 40))
    sync = GRPOTrainer(
        tiny_model("qwen2-tied"),
        digit_fraction,
        train_dataset=prompts,
        args=config("learning_sync", max_steps=steps, beta=0.05),
    )
    sync.train()
    teardown(sync)
    trainer = AsyncGRPOTrainer(
        tiny_model("qwen2-tied"),
        digit_fraction,
        train_dataset=prompts,
        args=config("learning", max_steps=steps, max_staleness=1, beta=0.05),
    )
    trainer.train()
    history = training_rows(trainer)
    teardown(trainer)
    return {"history": history, "sync_history": training_rows(sync)}


# ------------------------------------------------------------------ 6. split placement: rank 0 trains, rank 1 generates
def split_run(name, **overrides):
    trainer = AsyncGRPOTrainer(
        tiny_model("qwen2-tied"),
        digit_fraction,
        train_dataset=prompts,
        args=config(name, async_placement="split", per_device_train_batch_size=16, max_staleness=1, **overrides),
    )
    plans = record_plans(trainer) if trainer.trains else None
    by_version = watch_split_versions(trainer)
    trainer.train()
    teardown(trainer)
    return {
        "trains": trainer.trains,
        "by_version": by_version,
        "plans": plans,
        "history": training_rows(trainer) if trainer.trains else None,
    }


@check("split")
def _():
    first = split_run("split", max_steps=4, save_steps=2)
    ckpt = os.path.join(OUT, "split", "checkpoint-2")
    extra = json.load(open(os.path.join(ckpt, "rollout_state_0.json")))
    resumed = split_run("split", max_steps=6, resume_from_checkpoint=ckpt)
    return {
        "first": first,
        "resumed": resumed,
        "generator_pools": {r: [g["position"] for g in s["pool"]] for r, s in extra.get("generators", {}).items()},
        "claimed_at_save": extra["claimed"],
    }


# ------------------------------------------------------------------ 7. an error in one rank's rollout worker
calls = {"n": 0}


def fails_on_rank1(prompts, completions, **kwargs):
    calls["n"] += 1
    if dist.rank() == 1 and calls["n"] == 3:
        raise ZeroDivisionError("reward exploded on purpose")
    return digit_fraction(prompts, completions)


@check("worker_error")
def _():
    trainer = AsyncGRPOTrainer(
        tiny_model("qwen2"),
        fails_on_rank1,
        train_dataset=prompts,
        args=config("error", max_steps=8, async_chunk_groups=1),
    )
    KEEP.append(trainer)
    start = time.perf_counter()
    try:
        trainer.train()
        message = None
    except RuntimeError as exc:
        message = str(exc)
    worker = rollout_worker(trainer)
    alive = worker._thread.is_alive() if worker._thread else False
    return {
        "message": message,
        "seconds": time.perf_counter() - start,
        "thread_alive": alive,
        "steps": trainer.state.global_step,
    }


with open(os.path.join(OUT, f"result-{dist.rank(dist.EVERYONE)}.json"), "w") as fh:
    json.dump(results, fh)
dist.barrier("results written", group=dist.EVERYONE)  # split placement leaves rank 0 a training group of one

from dsgrpo.process_exit import leave  # noqa: E402

leave(0)  # out without the interpreter's teardown (dsgrpo/process_exit.py): 2.5 s a rank
