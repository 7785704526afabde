"""Run under `torchrun --nproc_per_node 2`: LoRA policies (`peft_config`) on real DeepSpeed ZeRO-3 and real
in-process vLLM, fp32 on CPU. Each check records numbers in OUT_DIR/result-<rank>.json; tests/test_lora_dist.py
asserts on them.

Usage: torchrun --nproc_per_node 2 tests/dist_scripts/lora_checks.py OUT_DIR [CHECK,...]
(split placement gives the ranks different roles for the life of the process: it runs in a launch of its own)
"""

import json
import os
import sys

import torch

from datasets import Dataset
from peft import LoraConfig

from dsgrpo import AsyncGRPOTrainer, GRPOTrainer, dist
from dsgrpo.engines.gather import GatherStats, full_parameters
from dsgrpo.engines.weights import checkpoint_units
from dsgrpo.testing import tiny_model
from recorder import (
    check_config,
    SHARDED_ZERO3,
    digit_fraction,
    policy_logps,
    recorder,
    training_rows,
    vllm_logps,
    watch_split_versions,
)

OUT = sys.argv[1]
ONLY = set(sys.argv[2].split(",")) if len(sys.argv) > 2 else None
results, KEEP = {}, []
check = recorder(results, ONLY)
BUCKET = 64 * 1024  # smaller than the embedding and the MLP matrices: each layer is gathered on its own


prompts = Dataset.from_list([{"prompt": f"Write some numbers {i}:"} for i in range(64)])


def lora_config():
    return LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0)


config = check_config(
    OUT,
    max_steps=3,
    max_completion_length=12,
    learning_rate=2e-2,
    seed=1,
    deepspeed=SHARDED_ZERO3,
    vllm_kv_cache_bytes=64 * 2**20,
    beta=0.04,
    weight_sync_bucket_bytes=BUCKET,
)


def all_weights(trainer):
    """Every parameter of the peft-wrapped policy (base and adapter), full, by its peft name."""
    return {n: t for n, t in full_parameters(list(trainer.policy.module.named_parameters()), 1 << 30)}


def watch_syncs(trainer):
    """After every weight sync: vLLM's and the policy's log-probs of FIXED, and the sync's peak gathered bytes."""
    syncs = []
    original = trainer.source.sync_weights

    def spy(policy_module, round_index, needed=True):
        GatherStats.reset()
        original(policy_module, round_index, needed)
        if needed:
            syncs.append(
                {
                    "round": trainer.state.generation_round,
                    "peak_gathered_bytes": GatherStats.peak_bytes,
                    "vllm": vllm_logps(trainer),
                    "policy": policy_logps(trainer.policy.engine),
                }
            )

    trainer.source.sync_weights = spy
    return syncs


def max_diff(a, b):
    return max(abs(x - y) for x, y in zip(a, b))


# ------------------------------------------------------------------ 0. adapter gradients under ZeRO-3 == one process
@check("lora_gradients")
def _():
    """The engine's full gradient of every adapter matrix after one backward over both ranks' micro-batches equals
    the gradient of the mean loss in one plain-torch process (B set non-zero first, so A has a gradient too)."""
    import deepspeed
    from deepspeed.utils import safe_get_full_grad
    from transformers import AutoModelForCausalLM

    from dsgrpo.engines.builder import ModelLoader, build_policy_engine, resolve
    from dsgrpo.engines.lora import wrap_with_lora

    args = config("lora_gradients", max_grad_norm=1e9)
    args.validate(world_size=2)
    ds = resolve(args.deepspeed, args, 128, "deepspeed", train=True, world_size=dist.world_size())

    def set_b(model):
        gen = torch.Generator().manual_seed(1)
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.data.copy_(torch.randn(p.shape, generator=gen) * 0.05)

    engine = build_policy_engine(
        wrap_with_lora(ModelLoader(ds, torch.float32).load(tiny_model("qwen2")), lora_config(), 0), args, ds
    )
    with deepspeed.zero.GatheredParameters(
        [p for n, p in engine.module.named_parameters() if ".lora_B." in n], modifier_rank=0
    ):
        set_b(engine.module)
    batches = [torch.randint(0, 500, (2, 12), generator=torch.Generator().manual_seed(r)) for r in range(2)]

    def loss_of(model, ids):
        return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.float().log_softmax(-1)[..., 7].mean()

    engine.backward(loss_of(engine, batches[dist.rank()]))
    grads = {n: safe_get_full_grad(p) for n, p in engine.module.named_parameters() if p.requires_grad}
    plain = wrap_with_lora(
        AutoModelForCausalLM.from_pretrained(tiny_model("qwen2"), dtype=torch.float32), lora_config(), 0
    )
    set_b(plain)
    (sum(loss_of(plain, ids) for ids in batches) / 2).backward()  # DeepSpeed averages over the ranks
    want = {n: p.grad for n, p in plain.named_parameters() if p.requires_grad}
    KEEP.append(engine)
    return {
        "names_match": sorted(grads) == sorted(want),
        "max_diff": max(float((grads[n] - want[n]).abs().max()) for n in want),
        "min_grad_norm": min(float(want[n].norm()) for n in want),
    }


# ------------------------------------------------------------------ 1. GRPOTrainer with a LoRA policy
@check("lora")
def _():
    trainer = GRPOTrainer(
        tiny_model("qwen2"),
        digit_fraction,
        train_dataset=prompts,
        peft_config=lora_config(),
        args=config("lora", save_steps=2, save_merged_model=True),
    )
    KEEP.append(trainer)
    module = trainer.policy.module
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    opt = trainer.policy.engine.optimizer
    units = checkpoint_units(module)
    before = all_weights(trainer)
    at_start = {"vllm": vllm_logps(trainer), "policy": policy_logps(trainer.policy.engine)}
    syncs = watch_syncs(trainer)
    trainer.train()
    after = all_weights(trainer)
    final_policy = policy_logps(trainer.policy.engine)
    moved = {n: float((after[n] - before[n]).abs().max()) for n in before}
    out = {
        "reference_engine": trainer.reference is not None,
        "ref_ds_config": trainer.ref_ds_config is not None,
        "trainable": sorted(trainable),
        "moved_trainable": max(moved[n] for n in trainable),
        "moved_frozen": max(moved[n] for n in moved if n not in trainable),
        "moved_lora_B": max(moved[n] for n in moved if ".lora_B." in n),
        "adapter_numel": sum(before[n].numel() for n in trainable),
        "frozen_numel": sum(before[n].numel() for n in before if n not in trainable),
        "optimizer_numel_here": sum(t.numel() for t in opt.fp32_partitioned_groups_flat),
        "model_bytes": sum(u.nbytes() for u in units),
        "largest_unit_bytes": max(u.nbytes() for u in units),
        "largest_layer_bytes": max(trainer.weight_sync.current.source.sharded_bytes()),
        "unit_names": [u.name for u in units],
        "at_start": at_start,
        "syncs": syncs,
        "history": training_rows(trainer),
        "final_policy": final_policy,
    }
    ckpt = os.path.join(OUT, "lora", "checkpoint-2")
    out["checkpoint_bytes"] = sum(
        os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(ckpt) for f in fs if f.endswith(".pt")
    )
    if dist.is_main():  # the saved adapter and merged model, reloaded in plain transformers/peft
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        saved = os.path.join(OUT, "lora")
        out["saved_files"] = sorted(os.listdir(saved))
        base = AutoModelForCausalLM.from_pretrained(tiny_model("qwen2"), dtype=torch.float32)
        out["reloaded_adapter"] = policy_logps(PeftModel.from_pretrained(base, saved).eval())
        merged = AutoModelForCausalLM.from_pretrained(os.path.join(saved, "merged"), dtype=torch.float32).eval()
        out["reloaded_merged"] = policy_logps(merged)
        base = AutoModelForCausalLM.from_pretrained(tiny_model("qwen2"), dtype=torch.float32).eval()
        out["base_model"] = policy_logps(base)
        out["adapter_config"] = json.load(open(os.path.join(saved, "adapter_config.json")))
    final_adapter = {n: after[n] for n in trainable}

    # resume from checkpoint-2 (adapter and optimizer only on disk): the third step comes out the same
    resumed = GRPOTrainer(
        tiny_model("qwen2"),
        digit_fraction,
        train_dataset=prompts,
        peft_config=lora_config(),
        args=config("lora_resumed", resume_from_checkpoint=ckpt, save_steps=3),
    )
    KEEP.append(resumed)
    resumed.train()
    again = all_weights(resumed)
    out["resume_adapter_diff"] = max(float((again[n] - final_adapter[n]).abs().max()) for n in trainable)
    out["resume_frozen_diff"] = max(float((again[n] - after[n]).abs().max()) for n in after if n not in trainable)
    out["resumed_steps"] = [h["step"] for h in training_rows(resumed)]
    return out


# ------------------------------------------------------------------ 2. a different adapter shape cannot resume it
@check("resume_other_adapter")
def _():
    try:
        GRPOTrainer(
            tiny_model("qwen2"),
            digit_fraction,
            train_dataset=prompts,
            peft_config=LoraConfig(r=4, lora_alpha=16, target_modules="all-linear"),
            args=config("lora_other", resume_from_checkpoint=os.path.join(OUT, "lora", "checkpoint-2")),
        )
    except Exception as exc:
        return {"error_type": type(exc).__name__, "message": str(exc)}
    return {"error_type": None}


# ------------------------------------------------------------------ 3. a PeftModel passed as `model` (a trained
#                                                                    adapter)
@check("peft_model_instance")
def _():
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_model("qwen2"), dtype=torch.float32), lora_config()
    )
    gen = torch.Generator().manual_seed(4)
    for n, p in model.named_parameters():  # as if trained: the merged weights differ from the base
        if ".lora_" in n:
            p.data.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    expected = policy_logps(model.eval())
    trainer = GRPOTrainer(model, digit_fraction, train_dataset=prompts, args=config("peft_instance", max_steps=1))
    KEEP.append(trainer)
    at_start = {"vllm": vllm_logps(trainer), "policy": policy_logps(trainer.policy.engine)}
    trainer.train()
    return {
        "expected": expected,
        "at_start": at_start,
        "reference_engine": trainer.reference is not None,
        "kl": training_rows(trainer)[0]["kl"],
    }


# ------------------------------------------------------------------ 4. AsyncGRPOTrainer (colocate) with a LoRA policy
@check("async_lora")
def _():
    trainer = AsyncGRPOTrainer(
        tiny_model("qwen2"),
        digit_fraction,
        train_dataset=prompts,
        peft_config=lora_config(),
        args=config("async_lora", max_staleness=0),
    )
    KEEP.append(trainer)
    trainer.train()  # its rollout worker is shut down when train() returns
    return {"history": training_rows(trainer)}


# ------------------------------------------------------------------ 5. split placement: rank 1 generates, rank 0 trains
@check("split_lora")
def _():
    trainer = AsyncGRPOTrainer(
        tiny_model("qwen2"),
        digit_fraction,
        train_dataset=prompts,
        peft_config=lora_config(),
        args=config("split_lora", async_placement="split", per_device_train_batch_size=16, max_staleness=1),
    )
    KEEP.append(trainer)
    by_version = watch_split_versions(trainer)  # merged weights: policy after each broadcast, vLLM once loaded
    trainer.train()
    return {
        "trains": trainer.trains,
        "by_version": by_version,
        "history": training_rows(trainer) if trainer.trains else None,
    }


with open(os.path.join(OUT, f"result-{dist.rank(dist.EVERYONE)}.json"), "w") as fh:
    json.dump(results, fh)
dist.barrier("results written", group=dist.EVERYONE)  # split placement leaves rank 0 a training group of one

from dsgrpo.process_exit import leave  # noqa: E402

leave(0)  # out without the interpreter's teardown (dsgrpo/process_exit.py): 2.5 s a rank
