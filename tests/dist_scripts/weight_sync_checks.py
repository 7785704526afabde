"""Run under `torchrun --nproc_per_node 2`: the weight sync (issue 45) on a real ZeRO-3 policy (every parameter
partitioned) and real in-process vLLM, fp32 on CPU. Records numbers per check in OUT_DIR/result-<rank>.json;
tests/test_weight_sync_dist.py asserts on them. The stall check runs last: it leaves the sync's group broken.

Usage: torchrun --nproc_per_node 2 tests/dist_scripts/weight_sync_checks.py OUT_DIR
"""

import json
import os
import sys
import time

import torch

from datasets import Dataset

from dsgrpo import GRPOConfig, GRPOTrainer, compat, dist
from dsgrpo.engines import completion_logprobs
from dsgrpo.engines.gather import DeepSpeedGather, GatherStats
from dsgrpo.engines.weights import named_full_parameters
from dsgrpo.rollout import Rollout
from dsgrpo.rollout.weight_source import Zero3WeightSource
from dsgrpo.rollout.weight_sync import WeightSyncError
from dsgrpo.testing import tiny_model
from recorder import recorder

OUT = sys.argv[1]
results = {}
check = recorder(results)

args = GRPOConfig(
    output_dir=os.path.join(OUT, "run"),
    max_steps=2,
    per_device_train_batch_size=4,
    num_generations=2,
    max_completion_length=6,
    learning_rate=1e-2,
    logging_steps=1,
    gradient_checkpointing=False,
    seed=3,
    deepspeed={
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "torch_adam": True}},
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
    },
    vllm_kv_cache_bytes=64 * 2**20,
    weight_sync_bucket_bytes=256 * 1024,
    verify_weight_sync="checksum",
    weight_sync_timeout_s=4,
    report_to="none",
    save_strategy="no",
)
prompts = Dataset.from_list([{"prompt": f"Count {i}:"} for i in range(8)])
trainer = GRPOTrainer(
    tiny_model("qwen2-tied"),
    lambda completions, **k: [float(len(c)) for c in completions],
    args=args,
    train_dataset=prompts,
)
module = trainer.policy.module
generator = trainer.generator
rank = dist.rank()
trainer.source.sync_weights(module, 0)  # the first sync builds the trainer's WeightSync (collective)
sync = trainer.weight_sync.current
PROBE = Rollout([[1, 5, 9, 12, 40, 41]], [[30, 31, 32, 33, 34, 35]], [[0.0] * 6], [True])


def gap_after_sync() -> dict:
    """vLLM's prompt log-probs of a fixed sequence against the policy's forward of it."""
    from vllm import SamplingParams

    ids = PROBE.prompt_ids[0] + PROBE.completion_ids[0]
    out = generator.llm.generate(
        [{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False
    )[0]
    served = [step[t].logprob for step, t in zip(out.prompt_logprobs[1:], ids[1:])][-6:]
    t = PROBE.tensors(trainer.tokenizer.pad_token_id)
    with torch.no_grad():
        mine, _ = completion_logprobs(trainer.policy.engine, t["input_ids"], t["attention_mask"], 6)
    return {"max_gap": max(abs(a - b) for a, b in zip(served, mine[0].tolist())), "served": served}


def nudge(scale: float) -> None:
    """Change every weight (this rank's partitions), as an optimizer step would."""
    with torch.no_grad():
        for p in module.parameters():
            compat.local_partition(p).mul_(scale).add_(0.001)


@check("source")
def _():
    """The source's metadata is its iteration, element for element; one group per decoder layer, the embedding's
    before and the final norm's after; nothing is gathered for metadata."""
    source = sync.source
    GatherStats.reset()
    meta = source.metadata()
    gathered_for_metadata = GatherStats.peak_bytes
    seen = [(n, str(t.dtype), tuple(t.shape)) for n, t in source]
    groups = source.groups()
    layers = trainer.policy.module.config.num_hidden_layers
    return {
        "meta": [(m.name, str(m.dtype), tuple(m.shape)) for m in meta],
        "seen": seen,
        "gathered_for_metadata": gathered_for_metadata,
        "groups": len(groups),
        "layers": layers,
        "first_group": groups[0],
        "last_group": groups[-1],
        "gather": sync.gather.name,
        "group_names_ok": [n for g in groups for n in g] == [m.name for m in meta],
    }


@check("shared_memory_equals_deepspeed")
def _():
    """Every tensor the shared-memory gather yields equals DeepSpeed's gather of it, bit for bit."""
    ds = Zero3WeightSource(module, True, DeepSpeedGather())
    worst, count = 0.0, 0
    for (name, mine), (other, theirs) in zip(sync.source, ds):
        assert name == other, (name, other)
        worst = max(worst, (mine.float() - theirs.float()).abs().max().item())
        count += 1
    old = dict(named_full_parameters(module, 1 << 20, True))  # the path before this source
    again = {n: t.clone() for n, t in sync.source}  # (views of the shared buffer are overwritten by later groups)
    worst_old = max((again[n].float() - t.float()).abs().max().item() for n, t in old.items())
    return {
        "worst": worst,
        "tensors": count,
        "worst_vs_old_path": worst_old,
        "names_same": sorted(old) == sorted(again),
    }


@check("native_sync")
def _():
    """New weights through vLLM's native API (in-process backend), checked by checksum: vLLM then serves the
    policy; every phase is timed; the extra memory held is at most one group plus one bucket."""
    nudge(1.05)
    stats = trainer.source.sync_weights(module, 4) or trainer.source.last_sync
    metrics = trainer.source.sync_metrics()
    groups = sync.source.sharded_bytes()
    return {
        **gap_after_sync(),
        "path": stats.path,
        "gather": stats.gather,
        "version": stats.version,
        "metrics": metrics,
        "engine_version": generator.llm.llm_engine.get_weight_version(),
        "bound": max(groups) + args.weight_sync_bucket_bytes,
        "peak_extra": stats.peak_extra_bytes,
    }


@check("versions")
def _():
    """Completions sampled now carry version 5 on every token, as vLLM labelled them; a round whose tokens say
    otherwise is refused."""
    from dsgrpo.rollout.sources import check_on_policy
    from dsgrpo.rollout.base import SamplingConfig

    rollout = generator.generate([[1, 5, 9]], [2], SamplingConfig(max_tokens=5, temperature=1.0))
    labelled = rollout.weight_versions
    raw = generator.llm.generate(
        [{"prompt_token_ids": [1, 5, 9]}], __import__("vllm").SamplingParams(max_tokens=3), use_tqdm=False
    )[0].outputs[0]
    refused = None
    try:
        check_on_policy(Rollout([[1]], [[2, 3]], [[0.0, 0.0]], [False], weight_versions=[[5, 4]]), 5)
    except RuntimeError as exc:
        refused = str(exc)
    return {
        "versions": labelled,
        "spans": [(s.version, s.start, s.end) for s in raw.weight_versions or []],
        "refused": refused,
    }


@check("reload_equals_native")
def _():
    """The fallback (vLLM's reload_weights, for a vLLM without the native API) serves the same log-probs."""
    native = gap_after_sync()["served"]
    generator.native_weights = False
    try:
        trainer.source.sync_weights(module, 4)
        reload = gap_after_sync()
        path = trainer.source.last_sync.path
    finally:
        generator.native_weights = True
    return {"diff": max(abs(a - b) for a, b in zip(native, reload["served"])), "gap": reload["max_gap"], "path": path}


@check("corruption_caught")
def _():
    """A tensor changed between the trainer's checksum and the engine's load (what a reused buffer overwritten too
    early would do) fails the sync naming it; a clean sync afterwards serves the policy again."""
    source = sync.source
    original = source.prepare

    def tampered(index):
        group = original(index)
        if index == 2:
            group.tensors[0] = group.tensors[0] + 1.0  # after its checksum was taken
        return group

    source.prepare = tampered
    error = None
    try:
        trainer.source.sync_weights(module, 5)
    except WeightSyncError as exc:
        error = str(exc)
    finally:
        source.prepare = original
    trainer.source.sync_weights(module, 5)
    return {"refusal": error, "tampered": source.groups()[2][0], **gap_after_sync()}


@check("stall")
def _():
    """Rank 1 stalls in the sync's shared-buffer barrier past weight_sync_timeout_s (4 s): the sync fails in about
    that long, naming the phase and the rank that did not arrive, instead of waiting for the process group's
    timeout."""
    barrier = sync.gather.barrier
    if rank == 1:

        def slow(reason):
            time.sleep(12)
            barrier(reason)

        sync.gather.barrier = slow
    start = time.perf_counter()
    error = None
    try:
        nudge(1.0)
        trainer.source.sync_weights(module, 6)
    except Exception as exc:  # noqa: BLE001 - recorded
        error = f"{type(exc).__name__}: {exc}"
    return {"failure": error, "seconds": time.perf_counter() - start}


with open(os.path.join(OUT, f"result-{rank}.json"), "w") as fh:
    json.dump(results, fh, default=str)
os._exit(0)  # the stalled group cannot be torn down cleanly
