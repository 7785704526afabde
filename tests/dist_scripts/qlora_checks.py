"""Run under `torchrun --nproc_per_node 2`: QLoRA (`quantization_config` + `peft_config`) on real DeepSpeed and real
in-process vLLM, on the CPU with bitsandbytes' CPU backend. Each check records numbers in OUT_DIR/result-<rank>.json;
tests/test_qlora_dist.py asserts on them.

Usage: torchrun --nproc_per_node 2 tests/dist_scripts/qlora_checks.py OUT_DIR [CHECK,...]
"""

import json
import os
import sys

import torch

from datasets import Dataset
from peft import LoraConfig
from transformers import BitsAndBytesConfig

from dsgrpo import GRPOTrainer, dist
from dsgrpo.engines.gather import full_parameters
from dsgrpo.testing import tiny_model
from recorder import (
    check_config,
    SHARDED_ZERO3,
    digit_fraction,
    policy_logps,
    recorder,
    training_rows,
    vllm_logps,
)

OUT = sys.argv[1]
ONLY = set(sys.argv[2].split(",")) if len(sys.argv) > 2 else None
results, KEEP = {}, []
check = recorder(results, ONLY)

prompts = Dataset.from_list([{"prompt": f"Write some numbers {i}:"} for i in range(64)])
ZERO2 = {**SHARDED_ZERO3, "zero_optimization": {"stage": 2}}
config = check_config(
    OUT,
    max_steps=3,
    max_completion_length=12,
    learning_rate=2e-2,
    seed=1,
    vllm_kv_cache_bytes=64 * 2**20,
    beta=0.04,
    weight_sync_bucket_bytes=64 * 1024,
)


def lora_config():
    return LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0)


def stored(trainer):
    """Every parameter of the policy as stored (a quantised base: its packed bytes), full, by its peft name."""
    return {n: t for n, t in full_parameters(list(trainer.policy.module.named_parameters()), 1 << 30)}


def watch_syncs(trainer):
    """vLLM's and the policy's log-probs of FIXED after every weight sync (the first before any generation)."""
    syncs = []
    original = trainer.source.sync_weights

    def spy(policy_module, round_index, needed=True):
        original(policy_module, round_index, needed)
        if needed:
            syncs.append(
                {"round": round_index, "vllm": vllm_logps(trainer), "policy": policy_logps(trainer.policy.engine)}
            )

    trainer.source.sync_weights = spy
    return syncs


def qlora_run(name: str, quantization, deepspeed) -> dict:
    """3 steps of a quantised base with a LoRA adapter, a checkpoint at step 2, then a resume from it."""
    trainer = GRPOTrainer(
        tiny_model("qwen2"),
        digit_fraction,
        train_dataset=prompts,
        peft_config=lora_config(),
        quantization_config=quantization,
        args=config(name, deepspeed=deepspeed, save_steps=2, save_merged_model=True),
    )
    KEEP.append(trainer)
    module = trainer.policy.module
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    quantised = sorted({type(m).__name__ for m in module.modules() if type(m).__module__.startswith("bitsandbytes")})
    before = stored(trainer)
    at_start = {"vllm": vllm_logps(trainer), "policy": policy_logps(trainer.policy.engine)}
    syncs = watch_syncs(trainer)
    trainer.train()
    after = stored(trainer)
    frozen = [n for n in before if n not in trainable]
    out = {
        "quantised_layers": quantised,
        "base_dtypes": sorted({str(before[n].dtype) for n in frozen if "layers." in n and "proj" in n}),
        "reference_engine": trainer.reference is not None,
        "moved_trainable": max(float((after[n] - before[n]).abs().max()) for n in trainable),
        "frozen_identical": all(torch.equal(after[n], before[n]) for n in frozen),
        "frozen_count": len(frozen),
        "at_start": at_start,
        "syncs": syncs,
        "history": training_rows(trainer),
        "final_policy": policy_logps(trainer.policy.engine),
    }
    if dist.is_main():  # the saved adapter on the full-precision base, in plain transformers/peft
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(tiny_model("qwen2"), dtype=torch.float32)
        out["reloaded_on_full_precision"] = policy_logps(
            PeftModel.from_pretrained(base, trainer.args.output_dir).eval()
        )
        merged = os.path.join(trainer.args.output_dir, "merged")  # the dequantised base + the adapter, merged
        out["reloaded_merged"] = policy_logps(AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval())
        out["saved_files"] = sorted(os.listdir(trainer.args.output_dir))
    resumed = GRPOTrainer(
        tiny_model("qwen2"),
        digit_fraction,
        train_dataset=prompts,
        peft_config=lora_config(),
        quantization_config=quantization,
        args=config(
            f"{name}_resumed",
            deepspeed=deepspeed,
            save_steps=3,
            resume_from_checkpoint=os.path.join(OUT, name, "checkpoint-2"),
        ),
    )
    KEEP.append(resumed)
    resumed.train()
    again = stored(resumed)
    out["resume_adapter_diff"] = max(float((again[n] - after[n]).abs().max()) for n in trainable)
    out["resume_frozen_identical"] = all(torch.equal(again[n], after[n]) for n in frozen)
    out["resumed_steps"] = [h["step"] for h in training_rows(resumed)]
    return out


# ------------------------------------------------------------------ 1. 4-bit nf4 (double quant) under ZeRO-3
@check("qlora_4bit_zero3")
def _():
    four = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)
    return qlora_run("qlora_4bit_zero3", four, SHARDED_ZERO3)


# ------------------------------------------------------------------ 2. 8-bit under ZeRO-2, from a YAML-style dict
@check("qlora_8bit_zero2")
def _():
    return qlora_run("qlora_8bit_zero2", {"load_in_8bit": True}, ZERO2)


# ------------------------------------------------------------------ 3. a model passed already loaded in 4 bits
@check("qlora_instance")
def _():
    """TRL's other form: the user loads the model quantised (fp4, its bytes stored as fp32) and passes it. The
    initial model vLLM loads is saved dequantised, so vLLM samples the quantised policy from its first token
    (before any sync)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        tiny_model("qwen2"),
        quantization_config=BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="fp4", bnb_4bit_quant_storage=torch.float32
        ),
        dtype=torch.float32,
    )
    trainer = GRPOTrainer(
        model,
        digit_fraction,
        train_dataset=prompts,
        peft_config=lora_config(),
        args=config("qlora_instance", deepspeed=SHARDED_ZERO3, max_steps=1),
    )
    KEEP.append(trainer)
    at_start = {"vllm": vllm_logps(trainer), "policy": policy_logps(trainer.policy.engine)}
    trainer.train()
    initial = os.path.join(trainer.args.output_dir, "initial_model")
    return {
        "at_start": at_start,
        "history": training_rows(trainer),
        "initial_config_quantised": "quantization_config" in json.load(open(os.path.join(initial, "config.json"))),
    }


# ------------------------------------------------------------------ 4. split placement (a launch of its own): rank 1
#                                                                    generates, rank 0 trains the 4-bit base
@check("qlora_split")
def _():
    """The generating rank holds no policy: it learns from the plan that the base is quantised and takes the
    dequantised weights before its first round, as after a resume."""
    from dsgrpo import AsyncGRPOTrainer

    trainer = AsyncGRPOTrainer(
        tiny_model("qwen2"),
        digit_fraction,
        train_dataset=prompts,
        peft_config=lora_config(),
        quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4"),
        args=config("qlora_split", async_placement="split", per_device_train_batch_size=16, max_staleness=1),
    )
    KEEP.append(trainer)
    by_version = {}
    if trainer.trains:  # the policy's log-probs as each version is sent (version = round index + 1)
        original = trainer.source.sync_weights

        def sync(policy_module, round_index, needed=True):
            original(policy_module, round_index, needed)
            if needed:
                by_version[round_index + 1] = policy_logps(trainer.policy.engine)

        trainer.source.sync_weights = sync
    else:  # vLLM's once it has loaded each version
        rank = trainer.generating_rank
        receive = rank.receive_weights

        def received(version):
            receive(version)
            with rank.worker.paused():
                by_version[version] = vllm_logps(trainer)

        rank.receive_weights = received
        by_version["before"] = vllm_logps(trainer)
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

leave(0)
