"""Run under `torchrun --nproc_per_node N` (N = 1 or 2): the same training with padded micro-batches (token_budget=0)
and with packed token-budget steps, on the same rollouts, for every loss type and the options that touch the
normalisers (issue 27). Rollouts come from a rollout_func, so both runs train on identical rows: long-tailed
lengths in one process; over two ranks rank 0's rows are all long and rank 1's all short (rank 1 needs fewer packed
steps and runs stand-ins). SGD, so parameter changes are the gradients. Records numbers in OUT/result-<rank>.json.

Usage: torchrun --nproc_per_node N tests/dist_scripts/packing_checks.py OUT
"""

import json
import os
import sys

import torch

from datasets import Dataset

from dsgrpo import GRPOConfig, GRPOTrainer, dist
from dsgrpo.testing import tiny_model
from recorder import SHARDED_ZERO3, recorder, train_recording

OUT = sys.argv[1]
results, KEEP = {}, []
check = recorder(results)
MAX_COMPLETION = 40
prompts = Dataset.from_list([{"prompt": f"p{i:02d}"} for i in range(64)])


def completion_length(prompt: str, k: int) -> int:
    """Long-tailed in one process; over two ranks rank 0 long, rank 1 short."""
    i = int(prompt[1:]) * 7 + k
    if dist.world_size() == 2:
        return 28 + i % 13 if dist.rank() == 0 else 1 + i % 4
    return MAX_COMPLETION if i % 9 == 0 else 1 + (i * 5) % 12


def rollout_func(prompts, trainer):
    """One row per completion, deterministic: token ids and sampler log-probs from the prompt and its occurrence."""
    seen, out = {}, {"prompt_ids": [], "completion_ids": [], "logprobs": []}
    tok = trainer.processing_class
    for p in prompts:
        k = seen[p] = seen.get(p, -1) + 1
        g = torch.Generator().manual_seed(int(p[1:]) * 31 + k)
        n = completion_length(p, k)
        ids = torch.randint(10, 200, (n,), generator=g).tolist()
        if n < MAX_COMPLETION and (n + k) % 3:  # some end with eos, the others are truncated
            ids[-1] = tok.eos_token_id
        out["prompt_ids"].append(tok(p)["input_ids"])
        out["completion_ids"].append(ids)
        out["logprobs"].append((-2.0 - torch.rand(n, generator=g)).tolist())
    return out


def length_reward(completions, completion_ids, **kwargs):
    return [float((len(ids) * 7) % 5) for ids in completion_ids]


def run(name: str, budget: int, **overrides) -> dict:
    args = dict(
        output_dir=os.path.join(OUT, f"{name}_{budget}"),
        max_steps=4,
        per_device_train_batch_size=4,
        num_generations=4,
        gradient_accumulation_steps=2,
        steps_per_generation=4,
        max_completion_length=MAX_COMPLETION,
        learning_rate=0.05,
        lr_scheduler_type="constant",
        logging_steps=1,
        gradient_checkpointing=False,
        seed=5,
        use_vllm=False,
        save_steps=10**6,
        report_to="none",
        token_budget=budget,
        shuffle_dataset=False,
    )
    args.update(overrides)
    t = GRPOTrainer(
        tiny_model("qwen2"),
        length_reward,
        args=GRPOConfig(**args),
        train_dataset=prompts,
        rollout_func=rollout_func,
        optimizers=(lambda params: torch.optim.SGD(params, lr=args["learning_rate"]), None),
    )
    KEEP.append(t)
    return train_recording(t)


def compare(name: str, budget: int, **overrides) -> dict:
    padded, packed = run(name, 0, **overrides), run(name, budget, **overrides)
    diff = max(
        max(
            abs(a - b)
            for a, b in zip(
                torch.tensor(padded["params"][n]).reshape(-1).tolist(),
                torch.tensor(packed["params"][n]).reshape(-1).tolist(),
            )
        )
        for n in padded["params"]
    )
    return {
        "param_diff": diff,
        "padded": {k: v for k, v in padded.items() if k != "params"},
        "packed": {k: v for k, v in packed.items() if k != "params"},
    }


@check("dapo_iterations_ref_entropy")
def _():
    """dapo's step-wide token count; two iterations (old log-probs), beta > 0 (reference log-probs), the top half
    of tokens by entropy, truncated completions masked."""
    return compare(
        "dapo",
        64,
        loss_type="dapo",
        num_iterations=2,
        beta=0.1,
        top_entropy_quantile=0.5,
        mask_truncated_completions=True,
    )


@check("gspo_window_across_rounds")
def _():
    """GSPO's sequence-level ratios, an entropy bonus and the off-policy mask (the rollout_func's log-probs as the
    behaviour policy); steps_per_generation 3 with 2 accumulation steps, so an optimizer step spans two rounds."""
    return compare(
        "gspo",
        64,
        loss_type="grpo",
        importance_sampling_level="sequence",
        entropy_coef=0.01,
        off_policy_mask_threshold=0.5,
        steps_per_generation=3,
        num_iterations=2,
        max_steps=3,
    )


@check("other_loss_types")
def _():
    return {
        lt: compare(lt, 100, loss_type=lt, max_steps=2, steps_per_generation=2)
        for lt in ("grpo", "bnpo", "dr_grpo", "luspo", "cispo", "sapo", "vespo")
    }


@check("zero3_sharded")
def _():
    """A ZeRO-3 config that really shards (persistence threshold 0) in both worlds."""
    return compare("zero3", 64, loss_type="dapo", deepspeed=SHARDED_ZERO3, max_steps=2, steps_per_generation=2)


@check("attention_that_leaks")
def _():
    """The default (None) packs where the model keeps packed sequences apart (qwen2) and falls back to padded
    micro-batches where it does not (OPT); a budget set explicitly on such a model is refused. On two ranks the
    probe's forwards run on every rank of the ZeRO-3 group."""
    out = {}
    for name, budget in (("qwen2", None), ("opt", None), ("opt", 64)):
        args = GRPOConfig(
            output_dir=os.path.join(OUT, f"leak_{name}_{budget}"),
            max_steps=1,
            per_device_train_batch_size=4,
            num_generations=4,
            max_completion_length=MAX_COMPLETION,
            use_vllm=False,
            report_to="none",
            token_budget=budget,
            gradient_checkpointing=False,
        )
        try:
            t = GRPOTrainer(tiny_model(name), length_reward, args=args, train_dataset=prompts)
            out[f"{name}_{budget}"] = {"budget": None if t.budget is None else t.budget.tokens}
            KEEP.append(t)
        except ValueError as e:
            out[f"{name}_{budget}"] = {"error": str(e)}
    return out


@check("budget_errors")
def _():
    try:
        run("too_small", 20)
    except ValueError as e:
        return {"message": str(e)}
    return {"message": None}


with open(os.path.join(OUT, f"result-{dist.rank()}.json"), "w") as fh:
    json.dump(results, fh)

from dsgrpo.process_exit import leave  # noqa: E402

leave(0)  # out without the interpreter's teardown (dsgrpo/process_exit.py): 2.5 s a rank
