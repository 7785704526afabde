"""Run under `torchrun --nproc_per_node 2`: TRL users' sampling settings and policies on real DeepSpeed ZeRO-3 and
real in-process vLLM (fp32, CPU): top_p / top_k / min_p sampling that must keep learning, and MoE policies whose
weights must reach vLLM. Each check records numbers in OUT/result-<rank>.json; tests/test_usage_dist.py asserts.

Usage: torchrun --nproc_per_node 2 tests/dist_scripts/usage_checks.py OUT [CHECK,CHECK,...]
"""

import json
import os
import sys

from datasets import Dataset

from dsgrpo import GRPOTrainer, dist
from dsgrpo.algorithms import Truncation
from dsgrpo.testing import tiny_model
from recorder import check_config
from recorder import SHARDED_ZERO3, after_each_sync, digit_fraction, policy_logps, recorder, training_rows, vllm_logps

OUT = sys.argv[1]
ONLY = set(sys.argv[2].split(",")) if len(sys.argv) > 2 else None
results, KEEP = {}, []
check = recorder(results, ONLY)
prompts = Dataset.from_list([{"prompt": f"Write some numbers {i}:"} for i in range(32)])


config = check_config(
    OUT,
    max_steps=3,
    max_completion_length=8,
    learning_rate=2e-3,
    seed=9,
    deepspeed=SHARDED_ZERO3,
    vllm_kv_cache_bytes=64 * 2**20,
)


def sampling_run(name, model="qwen2", untruncated_trainer=False, **sampling):
    t = GRPOTrainer(tiny_model(model), digit_fraction, train_dataset=prompts, args=config(name, **sampling))
    KEEP.append(t)
    if untruncated_trainer:  # what dsgrpo did before: the trainer scores the unfiltered distribution
        t.update.truncation = t.truncation = Truncation()
    before = policy_logps(t.policy.engine)
    t.train()
    after = policy_logps(t.policy.engine)
    return {"history": training_rows(t), "moved": max(abs(a - b) for a, b in zip(after, before))}


# ------------------------------------------------------------------ 1. truncated sampling keeps learning
@check("truncated_sampling")
def _():
    return {
        "top_p": sampling_run("top_p", top_p=0.9),
        "top_k": sampling_run("top_k", top_k=10),
        "min_p": sampling_run("min_p", min_p=0.1),
        "top_k_as_before": sampling_run("top_k_before", top_k=10, untruncated_trainer=True),
    }


# ------------------------------------------------------------------ 2. mixture-of-experts policies
def moe_run(model, **overrides):
    """Train a MoE policy; after every weight sync compare vLLM's log-probs of a fixed sequence with the policy's;
    export the final model (its log-probs under AutoModelForCausalLM and vLLM are compared by the pytest side)."""
    name, peft = overrides.pop("name", model), overrides.pop("peft", None)
    t = GRPOTrainer(
        tiny_model(model),
        digit_fraction,
        train_dataset=prompts,
        peft_config=peft,
        args=config(f"moe_{name}", **{"learning_rate": 5e-3, "beta": 0.05, **overrides}),
    )
    KEEP.append(t)
    syncs = [{"vllm": vllm_logps(t), "policy": policy_logps(t.policy.engine)}]

    def record(needed):
        if needed:
            syncs.append({"vllm": vllm_logps(t), "policy": policy_logps(t.policy.engine)})

    after_each_sync(t, record)
    t.train()
    final = policy_logps(t.policy.engine)
    return {
        "syncs": syncs,
        "final_policy": final,
        "export": t.args.output_dir,
        "history": training_rows(t),
        "moved": max(abs(a - b) for a, b in zip(final, syncs[0]["policy"])),
    }


@check("moe")
def _():
    from peft import LoraConfig

    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], lora_dropout=0.0)
    return {
        "qwen3-moe": moe_run("qwen3-moe"),
        "qwen2-moe": moe_run("qwen2-moe"),
        "qwen3-moe-lora": moe_run("qwen3-moe", name="qwen3-moe-lora", peft=lora, learning_rate=5e-2),
    }


with open(os.path.join(OUT, f"result-{dist.rank()}.json"), "w") as fh:
    json.dump(results, fh, default=str)
dist.barrier("results written")

from dsgrpo.process_exit import leave  # noqa: E402

leave(0)  # out without the interpreter's teardown (dsgrpo/process_exit.py): 2.5 s a rank
