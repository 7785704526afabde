"""One run of the world-size-change tests (tests/test_world_change_dist.py), under torchrun with 1 or 2 ranks.

    world_change_run.py OUT [--resume CKPT] [--stop-at STEP] [--variant zero3|offload|lora|async|auto] [--per-device N]

Every run has the same global geometry whatever its world size: 4 prompts × 2 completions per round, one optimizer
step per round (per_device_train_batch_size = 8 / world), 8 prompts (an epoch is 2 rounds), 6 steps in all, a
checkpoint every 2. It writes, on rank 0:
    OUT/state_begin.pt        parameters (fp32 master), Adam moments, lr and step right after the resume
    OUT/state_step<S>.pt      the same after step S, for every S that is saved
    OUT/prompts.jsonl         each round's prompts as the reward function saw them (every rank, one line per call)
    OUT/pool_begin.json       async: the pooled groups' stream positions right after the resume
    OUT/trained_positions.jsonl  async: the stream positions each step trained on
    OUT/rows.json             the training rows of the log history
"""

import argparse
import json
import os

import torch

from datasets import Dataset

from dsgrpo import AsyncGRPOTrainer, GRPOConfig, GRPOTrainer, dist
from dsgrpo.testing import tiny_model
from recorder import SHARDED_ZERO3, training_rows

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--resume", default=None)
parser.add_argument("--stop-at", type=int, default=None)
parser.add_argument("--per-device", type=int, default=None)
parser.add_argument("--variant", default="zero3", choices=["zero3", "offload", "lora", "async", "auto"])
opts, _ = parser.parse_known_args()  # launchers' --local_rank=N
world = int(os.environ.get("WORLD_SIZE", 1))

ds_config = dict(SHARDED_ZERO3)
if opts.variant == "offload":
    ds_config["zero_optimization"] = {
        **SHARDED_ZERO3["zero_optimization"],
        "offload_optimizer": {"device": "cpu"},
        "offload_param": {"device": "cpu"},
    }
if opts.variant in ("auto", "lora"):  # what the memory plan picks: ZeRO-2 with whole weights for this tiny model
    ds_config = "auto"
trainer_cls = AsyncGRPOTrainer if opts.variant == "async" else GRPOTrainer
args = GRPOConfig(
    output_dir=opts.out,
    max_steps=6,
    per_device_train_batch_size=opts.per_device or 8 // world,
    num_generations=2,
    max_completion_length=8,
    learning_rate=5e-3,
    lr_scheduler_type="linear",
    warmup_steps=1,
    gradient_checkpointing=False,
    logging_steps=1,
    save_steps=2,
    seed=3,
    report_to="none",
    resume_from_checkpoint=opts.resume,
    vllm_kv_cache_bytes=32 * 2**20,
    deepspeed=ds_config,
)
data = Dataset.from_list([{"prompt": f"Numbers please, {i}:"} for i in range(8)])
trainer = None


def digit_fraction(prompts, completions, **kwargs):
    with open(os.path.join(opts.out, "prompts.jsonl"), "a") as fh:
        fh.write(
            json.dumps(
                {"rank": dist.rank(), "round": trainer.state.generation_round if trainer else -1, "prompts": prompts}
            )
            + "\n"
        )
    return [sum(ch.isdigit() for ch in c) / max(1, len(c)) for c in completions]


def engine_state(engine) -> dict:
    """Whole fp32 parameters and Adam moments of every trained parameter (collective under ZeRO-3)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out = {"lr": engine.get_lr(), "global_steps": engine.global_steps, "params": {}}
    for name, p in engine.module.named_parameters():
        if p.requires_grad:
            out["params"][name] = {
                "fp32": safe_get_full_fp32_param(p),
                "exp_avg": safe_get_full_optimizer_state(p, "exp_avg"),
                "exp_avg_sq": safe_get_full_optimizer_state(p, "exp_avg_sq"),
            }
    return out


def dump(name: str) -> None:
    state = engine_state(trainer.policy.engine)
    if dist.is_main():
        torch.save(state, os.path.join(opts.out, name))


class Dumps:
    def on_train_begin(self, args, state, control, **kw):
        if not opts.resume:
            return
        dump("state_begin.pt")
        if opts.variant == "async":
            held = dist.all_gather_object([p for _, p in trainer.source.exchange.pool.summary()])
            if dist.is_main():
                json.dump(sorted(p for h in held for p in h), open(os.path.join(opts.out, "pool_begin.json"), "w"))

    def on_step_end(self, args, state, control, **kw):
        if opts.variant == "async" and dist.is_main():  # the stream positions this step trained on
            with open(os.path.join(opts.out, "trained_positions.jsonl"), "a") as fh:
                fh.write(json.dumps(sorted(p for _, p, _ in trainer.source.last_plan.chosen)) + "\n")
        if state.global_step % args.save_steps == 0:
            dump(f"state_step{state.global_step}.pt")
        if opts.stop_at is not None and state.global_step >= opts.stop_at:
            control.should_training_stop = True


os.makedirs(opts.out, exist_ok=True)
kwargs = {}
if opts.variant == "lora":
    from peft import LoraConfig

    kwargs["peft_config"] = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
trainer = trainer_cls(tiny_model("qwen2"), digit_fraction, args=args, train_dataset=data, callbacks=[Dumps()], **kwargs)
trainer.train()
if dist.is_main():
    json.dump(training_rows(trainer), open(os.path.join(opts.out, "rows.json"), "w"))

from dsgrpo.process_exit import leave  # noqa: E402

leave(0)  # out without the interpreter's teardown (dsgrpo/process_exit.py): 2.5 s a rank
