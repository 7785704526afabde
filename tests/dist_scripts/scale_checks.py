"""Run under `torchrun --nproc_per_node 2`: generation at scale on real DeepSpeed ZeRO-3 and real vLLM (fp32, CPU):
colocated tensor parallelism (vllm_tensor_parallel_size=2: one engine over both ranks). Each check records numbers
in OUT/result-<rank>.json; tests/test_scale_dist.py asserts on them.

Usage: torchrun --nproc_per_node 2 tests/dist_scripts/scale_checks.py OUT TOOL_MODEL [CHECK,CHECK,...]
(TOOL_MODEL: the tiny tool-calling model of tests/test_api_dist.py, for the environment checks.)
"""

import json
import os
import sys

from datasets import Dataset

from dsgrpo import AsyncGRPOTrainer, GRPOTrainer, dist
from dsgrpo.engines.weights import named_full_parameters
from dsgrpo.testing import Ledger, tiny_model
from recorder import check_config
from recorder import (
    SHARDED_ZERO3,
    after_each_sync,
    digit_fraction,
    policy_logps,
    recorder,
    spy_batches,
    training_rows,
    vllm_logps,
)

OUT, TOOL_MODEL = sys.argv[1], sys.argv[2]
ONLY = set(sys.argv[3].split(",")) if len(sys.argv) > 3 else None
results, KEEP = {}, []
check = recorder(results, ONLY)
prompts = Dataset.from_list([{"prompt": f"Write some numbers {i}:"} for i in range(64)])


config = check_config(
    OUT,
    max_steps=5,
    max_completion_length=12,
    learning_rate=2e-3,
    seed=1,
    deepspeed=SHARDED_ZERO3,
    vllm_kv_cache_bytes=64 * 2**20,
    vllm_tensor_parallel_size=2,
)


def trainer_for(name, model="qwen2-tied", trainer=GRPOTrainer, **overrides):
    t = trainer(tiny_model(model), digit_fraction, train_dataset=prompts, args=config(name, **overrides))
    KEEP.append(t)
    return t


def full(t):
    return {n: x.clone() for n, x in named_full_parameters(t.policy.module, 1 << 30)}


# ------------------------------------------------------------------ 1. one engine over two ranks: in step with the
#                                                                    policy
@check("tp_sync")
def _():
    t = trainer_for("tp_sync", beta=0.05)
    syncs = [{"vllm": vllm_logps(t), "policy": policy_logps(t.policy.engine)}]

    def record(needed):
        if needed:
            syncs.append({"vllm": vllm_logps(t), "policy": policy_logps(t.policy.engine)})

    after_each_sync(t, record)
    t.train()

    def engine_shapes(worker):  # what this rank's engine shard holds (vLLM's internals: a test may look)
        return {
            n: list(p.shape)
            for n, p in worker.model_runner.get_model().named_parameters()
            if "layers.0.self_attn.qkv_proj" in n or "layers.0.mlp.down_proj" in n
        }

    return {
        "syncs": syncs,
        "history": training_rows(t),
        "engine_shapes": t.generator.llm.collective_rpc(engine_shapes)[0],
    }


# ------------------------------------------------------------------ 2. learning on the digit task
@check("tp_learning")
def _():
    t = trainer_for("tp_learning", max_steps=int(os.environ.get("LEARN_STEPS", 40)), beta=0.05)
    t.train()
    return {"rewards": [h["reward"] for h in training_rows(t)]}


# ------------------------------------------------------------------ 3. resume is exact
@check("tp_resume")
def _():
    straight = trainer_for("tp_straight", max_steps=4)
    straight.train()
    a = full(straight)
    first = trainer_for("tp_resume", max_steps=2, save_steps=2)
    first.train()
    second = trainer_for(
        "tp_resume", max_steps=4, resume_from_checkpoint=os.path.join(OUT, "tp_resume", "checkpoint-2")
    )
    second.train()
    b = full(second)
    return {
        "max_diff": max((a[n] - b[n]).abs().max().item() for n in a),
        "rewards": [[h["reward"] for h in training_rows(x)] for x in (straight, second)],
    }


# ------------------------------------------------------------------ 4. AsyncGRPOTrainer on a sharded engine
@check("tp_async")
def _():
    """The engine's first rank claims and generates; the other mirrors each call. On-policy (max_staleness 0) it
    must train exactly what GRPOTrainer trains; then a run that overlaps generation with training (staleness 1)."""
    t = trainer_for("tp_async", trainer=AsyncGRPOTrainer, beta=0.05, max_staleness=0)
    syncs = []

    def record(needed):
        if needed:
            with t.source.paused():  # the mirror and the leader's worker held still: the same call on both ranks
                syncs.append({"vllm": vllm_logps(t), "policy": policy_logps(t.policy.engine)})

    after_each_sync(t, record)
    t.train()
    overlap = trainer_for("tp_async_overlap", trainer=AsyncGRPOTrainer, max_staleness=1, max_steps=6)
    overlap.train()
    worker = overlap.source.worker
    return {
        "syncs": syncs,
        "history": training_rows(t),
        "worker": type(t.source.worker).__name__,
        "overlap": training_rows(overlap),
        "overlap_generated": worker.completions_generated,
    }


# ------------------------------------------------------------------ 5. environments on one engine over two ranks
def environment_run(name, trainer_class, **settings):
    """A stateful environment's tool turns through the sharded engine. Rows alternate two prompts that ask for a
    call with two that do not, so one rank may have turns to continue while the other has none: that rank joins
    the engine's call with no rows (the ranks of an engine must make the same calls)."""
    asks = ["What is 2 plus 3?", "Make it explode."]
    data = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": asks[i % 2] if i % 4 < 2 else "Hello there."}]} for i in range(32)]
    )
    t = trainer_class(
        TOOL_MODEL,
        lambda completions, **kw: [0.0] * len(completions),
        train_dataset=data,
        environment_factory=Ledger,
        args=config(
            name,
            max_steps=2,
            max_completion_length=192,
            temperature=0.3,
            learning_rate=1e-4,
            max_tool_calling_iterations=2,
            tool_timeout_s=0.5,
            shuffle_dataset=False,
            **settings,
        ),
    )
    KEEP.append(t)
    calls, own = [], []
    engine_generate, rank_generate = t.generator.engine.generate, t.generator.generate

    def engine_spy(prompt_ids, counts, sampling, seeds=None):  # every call the engine makes: every rank's rows
        calls.append(len(prompt_ids))
        return engine_generate(prompt_ids, counts, sampling, seeds=seeds)

    def rank_spy(prompt_ids, counts, sampling, seeds=None):  # GRPOTrainer's calls: this rank's rows
        own.append(len(prompt_ids))
        return rank_generate(prompt_ids, counts, sampling, seeds=seeds)

    t.generator.engine.generate, t.generator.generate = engine_spy, rank_spy

    def read(batch):  # read when scored: the next round resets the pool's instances
        r = batch.rollout
        envs = (r.columns or {}).get("environments")  # (the async trainer's groups another rank made: none)
        return [
            {
                "answered": c[0] - c[1],
                "calls": c[0],
                "inserted": sum(1 for m in mask if m == 0),
                "env_adds": len(envs[k].calls) if envs else None,
                "text": t.tokenizer.decode(ids),
            }
            for k, (c, mask, ids) in enumerate(zip(r.tool_counts, r.tool_mask, r.completion_ids))
        ]

    rows = spy_batches(t, read)
    t.train()
    return {"history": training_rows(t), "engine_calls": calls, "rows": rows, "own": own}


@check("tp_environments")
def _():
    return environment_run("tp_environments", GRPOTrainer)


@check("tp_async_environments")
def _():
    return environment_run("tp_async_environments", AsyncGRPOTrainer, max_staleness=1, async_chunk_groups=1)


with open(os.path.join(OUT, f"result-{dist.rank()}.json"), "w") as fh:
    json.dump(results, fh, default=str)
dist.barrier("results written")

from dsgrpo.process_exit import leave  # noqa: E402

leave(0)  # out without the interpreter's teardown (dsgrpo/process_exit.py): 2.5 s a rank
