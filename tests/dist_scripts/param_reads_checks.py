"""Run under `torchrun --nproc_per_node N` (N = 1 or 2): user code that reads trainer.model's parameters the way
TRL's tests and callbacks do (autograd-tracked clones, detached clones, sums and norms with and without grad) before
training, in a callback after every step and after training, and the same run without those reads (issue 26). The
default DeepSpeed config resolves by the memory plan ('auto': ZeRO-2 and a whole reference wherever the weights
fit, which a tiny model's do in both worlds); an explicit ZeRO-3 config that really shards runs in both worlds.
Records numbers in OUT/result-<rank>.json.

Usage: torchrun --nproc_per_node N tests/dist_scripts/param_reads_checks.py OUT
"""

import json
import os
import sys

import torch

from datasets import Dataset

from dsgrpo import GRPOConfig, GRPOTrainer, dist
from dsgrpo.engines.weights import named_full_parameters
from dsgrpo.testing import tiny_model
from recorder import SHARDED_ZERO3, digit_fraction, policy_logps, recorder, vllm_logps

OUT = sys.argv[1]
results, KEEP, kept = {}, [], []
check = recorder(results)
prompts = Dataset.from_list([{"prompt": f"Write some numbers {i}:"} for i in range(32)])


def read(model) -> None:
    """What user code does with the parameters; the autograd-tracked results are kept alive, as TRL's dict is."""
    for p in model.parameters():
        kept.extend([p.clone(), p.detach().clone(), p.sum(), p.norm() if p.numel() else p.sum()])
        with torch.no_grad():
            kept.extend([p.clone(), p.sum()])


class Reader:
    def on_step_end(self, args, state, control, model=None, **kwargs):
        read(model)
        return control


def trainer(name, reads: bool, **overrides):
    args = dict(
        output_dir=os.path.join(OUT, name),
        max_steps=3,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=8,
        learning_rate=1e-2,
        lr_scheduler_type="constant",
        logging_steps=1,
        gradient_checkpointing=False,
        seed=5,
        use_vllm=False,
        save_steps=10**6,
        report_to="none",
    )
    args.update(overrides)
    t = GRPOTrainer(
        tiny_model("qwen2"),
        digit_fraction,
        args=GRPOConfig(**args),
        train_dataset=prompts,
        callbacks=[Reader()] if reads else None,
    )
    KEEP.append(t)
    return t


def full(module):
    return {n: t.clone() for n, t in named_full_parameters(module, 1 << 30)}


def stage(t) -> int:
    return t.ds_config.get("zero_optimization", {}).get("stage", 0)


def with_and_without_reads(name, **overrides) -> dict:
    finals, stages, losses = {}, {}, {}
    for reads in (False, True):
        t = trainer(f"{name}_{'reads' if reads else 'plain'}", reads, **overrides)
        if reads:
            read(t.model)
        t.train()
        if reads:
            read(t.model)
        finals[reads], stages[reads] = full(t.model), stage(t)
        losses[reads] = [h["loss"] for h in t.state.log_history if "loss" in h and "train_runtime" not in h]
    moved_from_start = max((finals[False][n] - full_initial[n]).abs().max().item() for n in full_initial)
    return {
        "stage": stages[True],
        "max_diff": max((finals[True][n] - finals[False][n]).abs().max().item() for n in finals[False]),
        "moved": moved_from_start,
        "losses": losses[True],
        "losses_plain": losses[False],
    }


_first = trainer("initial", False, max_steps=1)
full_initial = full(_first.model)


@check("auto")
def _():
    return with_and_without_reads("auto")


@check("sharded_zero3")
def _():
    return with_and_without_reads("zero3", deepspeed=SHARDED_ZERO3)


def trl_pattern(name, **overrides):
    """TRL's tests: clone every parameter, train, and see each one move through get_parameter (real weights by
    default; under ZeRO-3 a parameter outside a gather is empty)."""
    t = trainer(name, False, learning_rate=0.1, beta=0.04, sync_ref_model=True, ref_model_sync_steps=1, **overrides)
    previous = {n: p.clone() for n, p in t.model.named_parameters()}
    previous_ref = {n: p.clone() for n, p in t.ref_model.named_parameters()}
    t.train()
    return {
        "stage": stage(t),
        "ref_stage": t.ref_ds_config.get("zero_optimization", {}).get("stage", 0),
        "unchanged": [n for n, p in previous.items() if torch.equal(p, t.model.get_parameter(n))],
        "empty": [n for n, p in t.model.named_parameters() if p.numel() == 0],
        "ref_unchanged": [n for n, p in previous_ref.items() if torch.equal(p, t.ref_model.get_parameter(n))],
        "ref_is_module": t.ref_model is t.reference.module,
        "no_ref_at_beta_0": KEEP[0].ref_model is None,
    }


@check("trl_pattern")
def _():
    return trl_pattern("trl_pattern")


if dist.world_size() > 1:

    @check("trl_pattern_zero3")
    def _():
        return trl_pattern("trl_pattern_zero3", deepspeed=SHARDED_ZERO3, ref_deepspeed="zero3_inference.json")


@check("training_step")
def _():
    """TRL's training_step hook: once per micro-step with the round's dataset rows; epochs count whole rounds (17
    prompts, 6 a round in one process → 2 rounds an epoch; 12 a round over two ranks → 1)."""
    from unittest.mock import patch

    data = Dataset.from_list([{"prompt": f"p{i:02d}"} for i in range(17)])
    args = GRPOConfig(
        output_dir=os.path.join(OUT, "training_step"),
        num_train_epochs=3,
        per_device_train_batch_size=6,
        num_generations=4,
        steps_per_generation=4,
        gradient_accumulation_steps=3,
        num_iterations=2,
        shuffle_dataset=False,
        max_completion_length=4,
        use_vllm=False,
        report_to="none",
        seed=5,
        gradient_checkpointing=False,
        save_steps=10**6,
    )
    t = GRPOTrainer(tiny_model("qwen2"), digit_fraction, args=args, train_dataset=data)
    KEEP.append(t)
    with patch.object(GRPOTrainer, "training_step", wraps=t.training_step) as spy:
        t.train()
    calls = spy.call_args_list
    return {
        "calls": len(calls),
        "model_is_policy": all(c.args[0] is t.model for c in calls),
        "first": [r["prompt"] for r in calls[0].args[1]],
        "ninth": [r["prompt"] for r in calls[8].args[1]],
        "rounds": t.state.generation_round,
        "epoch": t.state.epoch,
    }


@check("gemma2_vllm")
def _():
    """TRL's tiny Gemma 2 in its tests: tied embeddings that vLLM computes from the embedding (no lm_head to send)
    and logits soft-capped after the head (which the chunked log-probs apply too). After training and a weight sync,
    vLLM's log-probs equal the policy's."""
    args = GRPOConfig(
        output_dir=os.path.join(OUT, "gemma2"),
        max_steps=2,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=8,
        learning_rate=1e-2,
        seed=5,
        report_to="none",
        vllm_kv_cache_bytes=64 * 2**20,
        gradient_checkpointing=False,
        save_steps=10**6,
    )
    t = GRPOTrainer(tiny_model("gemma2"), digit_fraction, args=args, train_dataset=prompts)
    KEEP.append(t)
    before = full(t.model)
    t.train()
    after = full(t.model)
    t.source.sync_weights(t.policy.module, t.state.generation_round)  # the last step's weights (training skips it)
    return {
        "policy": policy_logps(t.policy.engine),
        "vllm": vllm_logps(t),
        "moved": max((after[n] - before[n]).abs().max().item() for n in before),
    }


with open(os.path.join(OUT, f"result-{dist.rank()}.json"), "w") as fh:
    json.dump(results, fh)

from dsgrpo.process_exit import leave  # noqa: E402

leave(0)  # out without the interpreter's teardown (dsgrpo/process_exit.py): 2.5 s a rank
