"""Run under `torchrun --nproc_per_node 2`: the same training without sequence parallelism (two data-parallel
ranks) and with a sequence-parallel group of both ranks (each packed step run on two shards through DeepSpeed's
Ulysses attention), on the same rollouts, for grpo, dapo, dr_grpo and GSPO, beta > 0, num_iterations 2, LoRA,
and a 20-step run (issue 28). Rollouts come from a rollout_func, so both runs train on identical rows; SGD, so
parameter changes are the gradients. Records numbers in OUT/result-<rank>.json.

Usage: torchrun --nproc_per_node 2 tests/dist_scripts/sp_checks.py OUT
"""

import json
import os
import sys

import torch

from datasets import Dataset

from dsgrpo import AsyncGRPOTrainer, GRPOConfig, GRPOTrainer, dist
from dsgrpo.testing import tiny_model
from recorder import SHARDED_ZERO3, recorder, train_recording

OUT = sys.argv[1]
results, KEEP = {}, []
check = recorder(results, only=os.environ.get("SP_CHECKS", "").split(",") if os.environ.get("SP_CHECKS") else None)
MAX_COMPLETION = 48
prompts = Dataset.from_list([{"prompt": f"p{i:02d}"} for i in range(64)])


def rollout_func(prompts, trainer):
    """One row per completion, deterministic from the prompt and its occurrence: lengths 1..48, rank 0's rows
    longer than rank 1's, token ids and sampler log-probs."""
    seen, out = {}, {"prompt_ids": [], "completion_ids": [], "logprobs": []}
    tok = trainer.processing_class
    for p in prompts:
        k = seen[p] = seen.get(p, -1) + 1
        g = torch.Generator().manual_seed(int(p[1:]) * 31 + k)
        i = int(p[1:]) * 7 + k
        n = MAX_COMPLETION if i % 9 == 0 else 1 + (i * 5) % (30 if dist.rank() == 0 else 12)
        ids = torch.randint(10, 200, (n,), generator=g).tolist()
        if n < MAX_COMPLETION and (n + k) % 3:
            ids[-1] = tok.eos_token_id
        out["prompt_ids"].append(tok(p)["input_ids"])
        out["completion_ids"].append(ids)
        out["logprobs"].append((-2.0 - torch.rand(n, generator=g)).tolist())
    return out


def length_reward(completions, completion_ids, **kwargs):
    return [float((len(ids) * 7) % 5) for ids in completion_ids]


def run(name: str, sp: int, peft_config=None, trainer_class=GRPOTrainer, **overrides) -> dict:
    args = dict(
        output_dir=os.path.join(OUT, f"{name}_sp{sp}"),
        max_steps=3,
        per_device_train_batch_size=4,
        num_generations=4,
        gradient_accumulation_steps=2,
        steps_per_generation=2,
        max_completion_length=MAX_COMPLETION,
        learning_rate=0.05,
        lr_scheduler_type="constant",
        logging_steps=1,
        gradient_checkpointing=False,
        seed=5,
        use_vllm=False,
        save_steps=10**6,
        report_to="none",
        token_budget=64,
        shuffle_dataset=False,
        deepspeed=SHARDED_ZERO3,
        parallelism_config={"sp_backend": "deepspeed", "sp_size": sp} if sp > 1 else None,
    )
    args.update(overrides)
    t = trainer_class(
        tiny_model("qwen2"),
        length_reward,
        args=GRPOConfig(**args),
        train_dataset=prompts,
        rollout_func=rollout_func,
        peft_config=peft_config,
        optimizers=(lambda params: torch.optim.SGD(params, lr=args["learning_rate"]), None),
    )
    KEEP.append(t)
    return dict(train_recording(t), sp=1 if t.budget.sp is None else t.budget.sp.size)


def compare(name: str, **overrides) -> dict:
    plain, sharded = run(name, 1, **overrides), run(name, 2, **overrides)
    diff = max(
        max(
            abs(a - b)
            for a, b in zip(
                torch.tensor(plain["params"][n]).reshape(-1).tolist(),
                torch.tensor(sharded["params"][n]).reshape(-1).tolist(),
            )
        )
        for n in plain["params"]
    )
    moved = {
        n: float((torch.tensor(sharded["params"][n]) - torch.tensor(plain["params"][n])).abs().max())
        for n in plain["params"]
    }
    return {
        "param_diff": diff,
        "worst": max(moved, key=moved.get),
        "plain": {k: v for k, v in plain.items() if k != "params"},
        "sharded": {k: v for k, v in sharded.items() if k != "params"},
    }


@check("grpo_ref_iterations")
def _():
    """grpo with beta > 0 (reference log-probs on shards) and two iterations (old log-probs on shards)."""
    return compare("grpo", loss_type="grpo", beta=0.1, num_iterations=2)


@check("dapo")
def _():
    return compare("dapo", loss_type="dapo", top_entropy_quantile=0.5, entropy_coef=0.01)


@check("dr_grpo")
def _():
    """With gradient checkpointing: the recomputation in backward runs through Ulysses too."""
    return compare("dr_grpo", loss_type="dr_grpo", gradient_checkpointing=True)


@check("gspo")
def _():
    """GSPO's sequence-level ratios: a sequence cut across shards still sums its own log-ratios."""
    return compare("gspo", loss_type="grpo", importance_sampling_level="sequence", num_iterations=2)


@check("lora")
def _():
    from peft import LoraConfig

    return compare(
        "lora",
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
        beta=0.1,
        learning_rate=0.5,
    )


@check("twenty_steps")
def _():
    return compare("long", loss_type="dapo", max_steps=20, steps_per_generation=2, learning_rate=0.02)


@check("async")
def _():
    """The asynchronous trainer (max_staleness 0, no balancing: the rows each rank trains on are fixed)."""
    return compare(
        "async",
        trainer_class=AsyncGRPOTrainer,
        loss_type="dapo",
        beta=0.1,
        max_staleness=0,
        async_load_balancing=False,
        async_chunk_groups=1,
        use_vllm=True,
        vllm_kv_cache_bytes=64 * 2**20,
    )


@check("knobs")
def _():
    """The DeepSpeed config's sequence_parallel_size means the same; refusals name the field and the fix."""
    out = {}
    ds = dict(SHARDED_ZERO3, sequence_parallel_size=2)
    args = dict(
        max_steps=1,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        use_vllm=False,
        report_to="none",
        gradient_checkpointing=False,
    )
    t = GRPOTrainer(
        tiny_model("qwen2"),
        length_reward,
        train_dataset=prompts,
        args=GRPOConfig(output_dir=os.path.join(OUT, "ds_knob"), deepspeed=ds, **args),
    )
    out["ds_config_size"] = t.budget.sp.size if t.budget.sp is not None else 1
    KEEP.append(t)
    for label, extra in (
        ("padded", dict(token_budget=0, parallelism_config={"sp_size": 2})),
        ("three", dict(parallelism_config={"sp_size": 3})),
        ("cp", dict(parallelism_config={"cp_size": 2})),
        ("disagree", dict(parallelism_config={"sp_size": 2}, deepspeed=dict(SHARDED_ZERO3, sequence_parallel_size=4))),
    ):
        try:
            GRPOTrainer(
                tiny_model("qwen2"),
                length_reward,
                train_dataset=prompts,
                args=GRPOConfig(output_dir=os.path.join(OUT, label), **{**args, **extra}),
            )
            out[label] = None
        except (ValueError, NotImplementedError) as e:
            out[label] = str(e)
    return out


with open(os.path.join(OUT, f"result-{dist.rank()}.json"), "w") as fh:
    json.dump(results, fh)

from dsgrpo.process_exit import leave  # noqa: E402

leave(0)  # out without the interpreter's teardown (dsgrpo/process_exit.py): 2.5 s a rank
