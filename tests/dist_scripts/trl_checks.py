"""Run under `torchrun --nproc_per_node 2`: what TRL users set, end to end on real DeepSpeed ZeRO-3 and real
in-process vLLM (fp32, CPU): several optimizer steps per round, every loss type, truncated-completion masking,
generation_kwargs and chat_template_kwargs, schedules, save strategies, save_only_model, resume through train(),
sync_ref_model, adaptive entropy, the cross-rank entropy quantile, callbacks' arguments, named eval sets,
completion logs, model_init_kwargs for every model, remove_unused_columns and a streamed train set. Each check
records numbers in OUT/result-<rank>.json; tests/test_trl_dist.py asserts on them.

Usage: torchrun --nproc_per_node 2 tests/dist_scripts/trl_checks.py OUT [CHECK,CHECK,...]
"""

import json
import os
import sys

import torch

from datasets import Dataset, IterableDataset

from dsgrpo import GRPOTrainer, dist
from dsgrpo.engines.weights import named_full_parameters
from dsgrpo.testing import tiny_model
from recorder import check_config, SHARDED_ZERO3, digit_fraction, policy_logps, recorder, training_rows

OUT = sys.argv[1]
ONLY = set(sys.argv[2].split(",")) if len(sys.argv) > 2 else None
results, KEEP = {}, []
check = recorder(results, ONLY)
prompts = Dataset.from_list([{"prompt": f"Write some numbers {i}:", "idx": i} for i in range(32)])


config = check_config(
    OUT,
    max_steps=2,
    max_completion_length=8,
    learning_rate=1e-3,
    seed=5,
    deepspeed=SHARDED_ZERO3,
    vllm_kv_cache_bytes=64 * 2**20,
)


def message_digits(prompts, completions, **kwargs):
    return digit_fraction(prompts, [c[-1]["content"] for c in completions])  # conversational: message lists


def trainer_for(name, reward=digit_fraction, model="qwen2", data=prompts, **overrides):
    trainer = GRPOTrainer(tiny_model(model), reward, args=config(name, **overrides), train_dataset=data)
    KEEP.append(trainer)  # a collected vLLM engine tears down process groups DeepSpeed still uses
    return trainer


def full(module):
    return {n: t.clone() for n, t in named_full_parameters(module, 1 << 30)}


# ------------------------------------------------------------------ 1. several optimizer steps per round
@check("several_steps")
def _():
    """num_iterations=2 and steps_per_generation > gradient_accumulation_steps: after the first step of a round,
    π_old ≠ π_θ, so some ratio leaves the clip range (learning rate 2e-2 moves a tiny model far in one step)."""
    out = {}
    for name, kw in {
        "num_iterations": dict(num_iterations=2, max_steps=4),
        "steps_per_generation": dict(steps_per_generation=2, max_steps=4),
    }.items():
        t = trainer_for(name, learning_rate=2e-2, **kw)
        t.train()
        out[name] = training_rows(t)
    return out


@check("accumulation_across_rounds")
def _():
    """steps_per_generation=2 with gradient_accumulation_steps=4 (TRL accepts it): one optimizer step spans two
    rounds, and it equals the step of a run that generates the same 4 micro-batches in one round
    (steps_per_generation=4). Completions come from a deterministic rollout_func, so both runs train on the same
    rows in the same order; grpo's loss is per micro-batch, so the two accumulations are the same sum."""

    def fixed_rollout(prompts_, trainer):
        ids = [trainer.tokenizer(p)["input_ids"] for p in prompts_]
        G = trainer.args.num_generations
        # row i is completion i % G of its prompt: a group's rows differ, so its advantages do
        completions = [[50 + (sum(x) + 97 * (i % G) * (t + 1)) % 900 for t in range(4)] for i, x in enumerate(ids)]
        return {"prompt_ids": ids, "completion_ids": completions, "logprobs": [[0.0] * 4 for _ in completions]}

    def even_tokens(prompts, completions, completion_ids, **kwargs):  # noqa: F811 (the reward contract's names)
        return [sum(t % 2 == 0 for t in c) / len(c) for c in completion_ids]

    runs = {}
    # plain SGD (Δw = -g): Adam's g / (|g| + eps) would magnify the summation-order noise of near-zero gradients
    # (the two runs sum the same micro-batch gradients on different ranks)
    sgd = {**SHARDED_ZERO3, "zero_allow_untested_optimizer": True}
    sgd.pop("optimizer")
    for name, spg in (("spanning", 2), ("one_round", 4)):
        t = GRPOTrainer(
            tiny_model("qwen2"),
            even_tokens,
            train_dataset=prompts,
            rollout_func=fixed_rollout,
            optimizers=(lambda params: torch.optim.SGD(params, lr=1.0), None),
            args=config(
                f"accumulation_{name}",
                max_steps=1,
                per_device_train_batch_size=2,
                gradient_accumulation_steps=4,
                steps_per_generation=spg,
                loss_type="grpo",
                vllm_importance_sampling_correction=False,
                shuffle_dataset=False,
                deepspeed=sgd,
            ),
        )
        KEEP.append(t)
        initial = full(t.policy.module)
        t.train()
        runs[name] = {
            "weights": full(t.policy.module),
            "rounds": t.state.generation_round,
            "steps": t.state.global_step,
            "initial": initial,
        }
    a, b = runs["spanning"], runs["one_round"]
    return {
        "rounds": [a["rounds"], b["rounds"]],
        "steps": [a["steps"], b["steps"]],
        "max_diff": max((a["weights"][n] - b["weights"][n]).abs().max().item() for n in a["weights"]),
        "moved": max((b["weights"][n] - b["initial"][n]).abs().max().item() for n in b["weights"]),
    }


@check("trl_step_counts")
def _():
    """TRL's test_prepare_input_called_with_correct_data on 2 ranks: the 17-row zen-sized set, 6 prompts a round
    (3 per device × 2 ranks × steps_per_generation 4 / G 4), num_iterations 2, gradient_accumulation_steps 3,
    3 epochs. TRL counts 2 rounds an epoch, 16 training_step calls an epoch in 6 optimizer steps (5 of 3 micro-steps
    and 1 of the 1 left), 18 steps in all. Records each optimizer step's micro-steps and the learning-rate schedule's
    length."""
    rows = Dataset.from_list([{"prompt": f"Zen line {i}:"} for i in range(17)])
    t = trainer_for(
        "trl_step_counts",
        data=rows,
        max_steps=-1,
        num_train_epochs=3,
        per_device_train_batch_size=3,
        steps_per_generation=4,
        num_iterations=2,
        gradient_accumulation_steps=3,
        max_completion_length=4,
        shuffle_dataset=False,
        lr_scheduler_type="linear",
        learning_rate=1e-3,
    )
    calls, windows, lrs = [0], [], []
    wrapped = t.training_step

    def counting(model, inputs, num_items_in_batch=None):
        calls[0] += 1
        return wrapped(model, inputs, num_items_in_batch)

    t.training_step = counting

    class Steps:
        def on_step_end(self, args, state, control, **kwargs):
            windows.append(calls[0] - sum(windows))
            lrs.append(t.policy.engine.get_lr()[0])
            return control

    t.add_callback(Steps())
    t.train()
    return {
        "calls": calls[0],
        "windows": windows,
        "steps": t.state.global_step,
        "max_steps": t.state.max_steps,
        "rounds": t.state.generation_round,
        "epoch": t.state.epoch,
        "last_lr": lrs[-1],
        "lrs": lrs,
    }


# ------------------------------------------------------------------ 2. every loss type, one trainer
LOSS_TYPES = [
    ("grpo", "token"),
    ("bnpo", "token"),
    ("dr_grpo", "token"),
    ("dapo", "token"),
    ("cispo", "token"),
    ("grpo", "sequence"),
    ("sapo", "token"),
    ("luspo", "sequence"),
    ("vespo", "token"),
]


@check("loss_types")
def _():
    """One round per variant on one trainer (the loss fields are read each micro-step): finite, the weights move,
    and each logs its own statistics."""
    t = trainer_for(
        "loss_types",
        max_steps=len(LOSS_TYPES),
        vllm_importance_sampling_mode="token_truncate",
        learning_rate=5e-3,
        beta=0.02,
    )
    rounds = []

    class Switch:
        def on_step_end(self, args, state, control, **kwargs):
            rounds.append({"logps": policy_logps(t.policy.engine)})
            if state.global_step < len(LOSS_TYPES):
                args.loss_type, args.importance_sampling_level = LOSS_TYPES[state.global_step]
            return control

    t.args.loss_type, t.args.importance_sampling_level = LOSS_TYPES[0]
    before = policy_logps(t.policy.engine)
    t.add_callback(Switch())
    t.train()
    moved = []
    for r in rounds:
        moved.append(max(abs(a - b) for a, b in zip(r["logps"], before)))
        before = r["logps"]
    return {"history": training_rows(t), "moved": moved}


# ------------------------------------------------------------------ 3. truncated completions out of the loss
@check("mask_truncated")
def _():
    t = trainer_for("mask_truncated", mask_truncated_completions=True, max_completion_length=3, max_steps=1)
    masks = []
    original = t.update._loss_mask

    def spy(mb, truncated):
        m = original(mb, truncated)
        masks.append(
            {
                "truncated": list(truncated),
                "row_tokens": m.sum(1).tolist(),
                "completion_tokens": mb["completion_mask"].sum(1).tolist(),
            }
        )
        return m

    t.update._loss_mask = spy
    t.train()
    return {"masks": masks}


# ------------------------------------------------------------------ 4. generation_kwargs and chat_template_kwargs
@check("generation_kwargs")
def _():
    """generation_kwargs={"top_k": 1} overrides top_k: every completion of a group is the same (zero std); a key
    only transformers' generate knows (num_beams) does not reach vLLM."""
    t = trainer_for("generation_kwargs", generation_kwargs={"top_k": 1, "num_beams": 1}, max_steps=1)
    t.train()
    return {"history": training_rows(t), "top_k": t.sampling.top_k}


@check("structured_outputs")
def _():
    """vllm_structured_outputs_regex: every completion is three digits."""
    t = trainer_for("structured_outputs", vllm_structured_outputs_regex="[0-9]{3}", max_steps=1)
    t.train()
    return {"history": training_rows(t)}


@check("chat_template_kwargs")
def _():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model("qwen2"))
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{{ preamble }}{% endif %}"
    )
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": f"count to {i}"}]} for i in range(8)])
    t = GRPOTrainer(
        tiny_model("qwen2"),
        message_digits,
        train_dataset=data,
        processing_class=tok,
        args=config("chat_template_kwargs", chat_template_kwargs={"preamble": "Sure: "}, max_steps=1),
    )
    KEEP.append(t)
    t.train()
    return {"prompt": tok.decode(t.train_prompts.prompt_ids[0]), "steps": t.state.global_step}


# ------------------------------------------------------------------ 5. schedules and save strategies
@check("schedule")
def _():
    t = trainer_for(
        "schedule",
        data=prompts.select(range(8)),
        max_steps=5,
        lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": 0.1},
        warmup_steps=0.4,
        save_strategy="epoch",
        logging_steps=0.4,
    )
    t.train()
    out = os.path.join(OUT, "schedule")
    records = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))] if dist.is_main() else []
    return {
        "lr": [h["learning_rate"] for h in training_rows(t)],
        "epochs": [h["epoch"] for h in training_rows(t)],
        "checkpoints": sorted(n for n in os.listdir(out) if n.startswith("checkpoint-")),
        "logged_steps": [r["step"] for r in records if "reward" in r],
    }


@check("save_only_model")
def _():
    t = trainer_for("save_only_model", max_steps=2, save_steps=0.5, save_only_model=True)
    t.train()
    ckpt = os.path.join(OUT, "save_only_model", "checkpoint-1")
    try:
        trainer_for("save_only_model", max_steps=3, resume_from_checkpoint=ckpt)
        refused = None
    except ValueError as exc:
        refused = str(exc)
    return {"files": sorted(os.listdir(ckpt)), "refused": refused}


@check("resume_via_train")
def _():
    first = trainer_for("resume_via_train", max_steps=2, save_steps=1)
    first.train()
    second = trainer_for("resume_via_train", max_steps=3)
    second.train(resume_from_checkpoint=True)  # TRL's spelling: the newest complete checkpoint
    return {
        "steps": [h["step"] for h in training_rows(second)],
        "resumed_at": second.last_checkpoint,
        "summary": second.state.log_history[-1],
    }


# ------------------------------------------------------------------ 6. sync_ref_model
@check("sync_ref_model")
def _():
    """After step 2 the reference is 0.5·policy + 0.5·(the initial reference = the initial policy)."""
    t = trainer_for(
        "sync_ref_model",
        max_steps=2,
        beta=0.1,
        sync_ref_model=True,
        ref_model_sync_steps=2,
        ref_model_mixup_alpha=0.5,
        learning_rate=5e-3,
    )
    initial = full(t.policy.module)
    seen = {}

    class AtStep2:
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                seen["policy"], seen["reference"] = full(t.policy.module), full(t.reference.module)
            return control

    t.add_callback(AtStep2())
    t.train()
    expected = {n: 0.5 * seen["policy"][n] + 0.5 * initial[n] for n in initial}
    return {
        "max_diff": max((seen["reference"][n] - expected[n]).abs().max().item() for n in initial),
        "moved": max((seen["policy"][n] - initial[n]).abs().max().item() for n in initial),
    }


# ------------------------------------------------------------------ 7. adaptive entropy, cross-rank entropy quantile
@check("adaptive_entropy")
def _():
    """entropy_target above any entropy: the coefficient rises by delta every step and the bonus applies from the
    second step on (the first has no measured entropy yet)."""
    t = trainer_for(
        "adaptive_entropy",
        max_steps=3,
        use_adaptive_entropy=True,
        entropy_coef=0.0,
        entropy_coef_delta=0.01,
        entropy_target=100.0,
    )
    t.train()
    return {"history": training_rows(t)}


@check("entropy_quantile")
def _():
    import dsgrpo.update as update

    thresholds = []
    original = update.entropy_threshold

    def spy(values, q):
        out = original(values, q)
        thresholds.append(float(out))
        return out

    update.entropy_threshold = spy
    t = trainer_for("entropy_quantile", max_steps=2, top_entropy_quantile=0.2)
    t.train()
    update.entropy_threshold = original
    return {"thresholds": thresholds}


# ------------------------------------------------------------------ 8. callbacks, eval sets, completion logs
@check("surface")
def _():
    seen = {}

    class Kwargs:
        def on_step_end(
            self, args, state, control, model=None, processing_class=None, optimizer=None, lr_scheduler=None, **kwargs
        ):
            seen.update(
                model=type(model).__name__,
                tokenizer=type(processing_class).__name__,
                optimizer=optimizer is not None,
                scheduler=type(lr_scheduler).__name__,
                args=type(args).__name__,
                epoch=state.epoch,
            )
            return control

    class Dropped:
        def on_step_end(self, args, state, control, **kwargs):
            seen["dropped_ran"] = True

    t = GRPOTrainer(
        tiny_model("qwen2"),
        digit_fraction,
        train_dataset=prompts,
        callbacks=[Kwargs, Dropped()],
        eval_dataset={"small": prompts.select(range(4)), "other": prompts.select(range(4, 8))},
        args=config(
            "surface",
            max_steps=2,
            eval_strategy="steps",
            eval_steps=2,
            log_completions=True,
            num_completions_to_print=3,
            log_unique_prompts=True,
            logging_steps=2,
        ),
    )
    KEEP.append(t)
    t.pop_callback(Dropped)
    t.train()
    rows = (
        [json.loads(line) for line in open(os.path.join(OUT, "surface", "completions.jsonl"))] if dist.is_main() else []
    )
    return {
        "seen": seen,
        "model_is_module": t.model is t.policy.module,
        "evals": [h for h in t.state.log_history if any(k.startswith("eval_") for k in h)],
        "completion_ranks": sorted({r["rank"] for r in rows}),
        "completion_rows": len(rows),
        "completion_steps": sorted({r["step"] for r in rows}),
        "summary": t.state.log_history[-1],
    }


# ------------------------------------------------------------------ 9. model_init_kwargs, remove_unused_columns,
#                                                                    streaming
@check("model_kwargs")
def _():
    keys_seen = []

    def keys(prompts, completions, **kwargs):
        keys_seen.append(sorted(kwargs))
        return digit_fraction(prompts, completions)

    t = GRPOTrainer(
        tiny_model("qwen2"),
        [keys, tiny_model("qwen2-reward")],
        train_dataset=prompts,
        args=config(
            "model_kwargs",
            max_steps=1,
            beta=0.1,
            remove_unused_columns=True,
            model_init_kwargs={"attn_implementation": "eager"},
        ),
    )
    KEEP.append(t)
    t.train()
    reward_model = t.rewards.funcs[1].forward.module
    return {
        "policy": t.policy.module.config._attn_implementation,
        "reference": t.reference.module.config._attn_implementation,
        "reward_model": reward_model.config._attn_implementation,
        "reward_kwargs": keys_seen[0],
    }


@check("streaming")
def _():
    rows = [{"prompt": f"Write some numbers {i}:", "idx": i} for i in range(6)]
    stream = IterableDataset.from_generator(lambda: iter(rows))
    seen = []

    def idx_reward(prompts, completions, idx, **kwargs):
        seen.append(sorted(set(idx)))
        return digit_fraction(prompts, completions)

    t = GRPOTrainer(
        tiny_model("qwen2"), idx_reward, train_dataset=stream, args=config("streaming", max_steps=3, save_steps=2)
    )
    KEEP.append(t)
    t.train()
    resumed = GRPOTrainer(
        tiny_model("qwen2"),
        idx_reward,
        train_dataset=stream,
        args=config("streaming", max_steps=3, resume_from_checkpoint=os.path.join(OUT, "streaming", "checkpoint-2")),
    )
    KEEP.append(resumed)
    resumed_seen_from = len(seen)
    resumed.train()
    return {"idx": seen[:resumed_seen_from], "resumed_idx": seen[resumed_seen_from:]}


with open(os.path.join(OUT, f"result-{dist.rank()}.json"), "w") as fh:
    json.dump(results, fh, default=str)
dist.barrier("results written")

from dsgrpo.process_exit import leave  # noqa: E402

leave(0)  # out without the interpreter's teardown (dsgrpo/process_exit.py): 2.5 s a rank
