"""Run under `torchrun --nproc_per_node 2`: the GRPOTrainer on real DeepSpeed ZeRO-3 engines and real
in-process vLLM, fp32 on CPU. Every check records its numbers in OUT_DIR/result-<rank>.json; the pytest side
(tests/test_trainer_dist.py) asserts on them, so one launch covers many assertions.

Usage: torchrun --nproc_per_node 2 tests/dist_scripts/trainer_checks.py OUT_DIR
"""

import json
import os
import sys

import torch

from datasets import Dataset

from dsgrpo import GRPOConfig, GRPOTrainer, dist
from recorder import recorder, training_rows
from dsgrpo.engines import completion_logprobs
from dsgrpo.engines.weights import named_full_parameters
from dsgrpo.rollout import Rollout
from dsgrpo.testing import tiny_model
from dsgrpo.rollout.batch import Batch

OUT = sys.argv[1]
results = {}


check = recorder(results)


def digit_fraction(prompts, completions, **kwargs):
    """Fraction of characters that are digits: near 0 for a random model, easy to raise by RL."""
    return [sum(ch.isdigit() for ch in c) / max(1, len(c)) for c in completions]


class StepCounter:
    def __init__(self):
        self.steps, self.logs, self.began, self.ended, self.evals = [], 0, 0, 0, []

    def on_train_begin(self, args, state, control, **kw):
        self.began += 1

    def on_step_end(self, args, state, control, **kw):
        self.steps.append(state.global_step)

    def on_log(self, args, state, control, logs=None, **kw):
        self.logs += 1

    def on_train_end(self, args, state, control, **kw):
        self.ended += 1

    def on_evaluate(self, args, state, control, metrics=None, **kw):
        self.evals.append(metrics)


prompts = Dataset.from_list([{"prompt": f"Write some numbers {i}:", "idx": i} for i in range(64)])
rank, world = None, None

# ------------------------------------------------------------------ 1. the vLLM trainer: tied model, beta > 0
counter = StepCounter()
seen_columns = []


def digit_fraction_with_column(prompts, completions, idx, **kwargs):
    seen_columns.append(len(idx) == len(completions))
    return digit_fraction(prompts, completions)


vllm_args = GRPOConfig(
    output_dir=os.path.join(OUT, "vllm_run"),
    max_steps=int(os.environ.get("LEARN_STEPS", 40)),
    per_device_train_batch_size=8,
    num_generations=4,
    max_completion_length=12,
    learning_rate=2e-3,
    lr_scheduler_type="constant",
    beta=0.05,
    logging_steps=1,
    gradient_checkpointing=False,
    seed=1,
    deepspeed={
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "torch_adam": True}},
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
    },
    vllm_kv_cache_bytes=64 * 2**20,
    weight_sync_bucket_bytes=64 * 1024,  # small buckets: many gathers
    vllm_enforce_eager=False,  # compiled (long runs on CPU, every GPU run): syncs must reach the compiled graph
    report_to=["wandb"],
    eval_strategy="steps",
    eval_steps=20,
    num_generations_eval=2,
)
os.environ["WANDB_MODE"] = "offline"
trainer = GRPOTrainer(
    tiny_model("qwen2-tied"),
    digit_fraction_with_column,
    args=vllm_args,
    train_dataset=prompts,
    eval_dataset=prompts.select(range(6)),
    callbacks=[counter],
)
rank, world = dist.rank(), dist.world_size()


@check("sharding")
def _():
    """persistence threshold 0: every parameter is partitioned; a rank holds ceil(numel / world) of it."""
    rows = []
    for name, p in trainer.policy.module.named_parameters():
        rows.append([name, int(p.ds_numel), int(p.ds_tensor.numel()), int(p.numel())])
    return {"params": rows, "has_reference": trainer.reference is not None}


def fixed_logps():
    """Policy log-probs of a fixed sequence (to show the weights change during training)."""
    r = Rollout([[1, 5, 9, 12]], [[30, 31, 32, 33]], [[0.0] * 4], [True])
    t = r.tensors(trainer.tokenizer.pad_token_id)
    with torch.no_grad():
        lp, _ = completion_logprobs(trainer.policy.engine, t["input_ids"], t["attention_mask"], 4)
    return lp[0].tolist()


check("initial_logps")(fixed_logps)


trainer.train()


@check("vllm_run")
def _():
    return {
        "history": training_rows(trainer),
        "final_logps": fixed_logps(),
        "callback_steps": counter.steps,
        "callback_logs": counter.logs,
        "began": counter.began,
        "ended": counter.ended,
        "max_steps": trainer.state.max_steps,
        "columns_ok": all(seen_columns) and bool(seen_columns),
        "evals": counter.evals,
        "eager": trainer.generator.llm.llm_engine.model_config.enforce_eager,
    }


# ------------------------------------------------------------------ 2. the HF-generate trainer: gradients
hf_args = GRPOConfig(
    output_dir=os.path.join(OUT, "hf_run"),
    max_steps=1,
    per_device_train_batch_size=2,
    gradient_accumulation_steps=2,
    num_generations=2,
    max_completion_length=6,
    temperature=0.7,
    use_vllm=False,
    gradient_checkpointing=False,
    logging_steps=1,
    max_grad_norm=0.0,
    deepspeed={
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "zero_allow_untested_optimizer": True,
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
    },
)
SGD_LR = 1.0  # Δw = -g exactly: the gradient itself can be compared, not Adam's sign-like first step
hf_trainer = GRPOTrainer(
    tiny_model("llama"),
    digit_fraction,
    args=hf_args,
    train_dataset=prompts,
    optimizers=(lambda params: torch.optim.SGD(params, lr=SGD_LR), None),
)


@check("hf_logprob_semantics")
def _():
    """The HF backend's sampler log-probs are the tempered log-probs the trainer computes for the same tokens."""
    ids = hf_trainer.train_prompts.prompt_ids[:2]
    rollout = hf_trainer.generator.generate(ids, [2, 2], hf_trainer.sampling)
    t = rollout.tensors(hf_trainer.tokenizer.pad_token_id)
    with torch.no_grad():
        lp, _ = completion_logprobs(
            hf_trainer.policy.engine,
            t["input_ids"],
            t["attention_mask"],
            t["completion_mask"].shape[1],
            hf_args.temperature,
        )
    gap = ((lp - t["sampler_logps"]).abs() * t["completion_mask"]).max().item()
    return {"max_gap": gap, "tokens": int(t["completion_mask"].sum())}


def fixed_rollouts():
    """8 completions of 4 prompts (G = 2) with varied lengths; rank r owns rows [4r, 4r + 4)."""
    g = torch.Generator().manual_seed(7)
    prompts_ids, completions = [], []
    for i in range(8):
        prompts_ids.append(torch.randint(3, 1000, (3 + (i // 2) % 3,), generator=g).tolist())
    for i in range(8):
        completions.append(torch.randint(3, 1000, (2 + (3 * i) % 5,), generator=g).tolist())
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 0.25, 0.75])
    return prompts_ids, completions, adv


@check("gradient")
def _():
    """One optimizer step on fixed rollouts (2 ranks x 2 micro-batches of 2, dapo over all ranks' tokens) equals
    plain single-process torch on the full batch of 8."""
    prompts_ids, completions, adv = fixed_rollouts()
    mine = slice(4 * rank, 4 * rank + 4)
    rollout = Rollout(
        [prompts_ids[i] for i in range(8)][mine],
        completions[mine],
        [[0.0] * len(c) for c in completions[mine]],
        [False] * 4,
    )
    B = hf_args.per_device_train_batch_size
    micro = [rollout.tensors(hf_trainer.tokenizer.pad_token_id, slice(s, s + B)) for s in range(0, 4, B)]
    batch = Batch(rollout, [None] * 4, [""] * 4, {}, micro)
    before = {n: t for n, t in named_full_parameters(hf_trainer.policy.module, 1 << 30)}
    metrics = hf_trainer.update.run(batch.micro, batch.rollout.truncated, adv[mine], None, None)
    after = {n: t for n, t in named_full_parameters(hf_trainer.policy.module, 1 << 30)}
    # reference: the same loss written out, one process, all 8 rows in one batch
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(tiny_model("llama"), dtype=torch.float32)
    full = Rollout(prompts_ids, completions, [[0.0] * len(c) for c in completions], [False] * 8)
    t = full.tensors(hf_trainer.tokenizer.pad_token_id)
    logits = ref(
        input_ids=t["input_ids"],
        attention_mask=t["attention_mask"],
        position_ids=(t["attention_mask"].cumsum(-1) - 1).clamp(min=0),
    ).logits
    T = t["completion_mask"].shape[1]
    logps = (
        torch.log_softmax(logits[:, -T - 1 : -1].float() / hf_args.temperature, -1)
        .gather(-1, t["input_ids"][:, -T:].unsqueeze(-1))
        .squeeze(-1)
    )
    mask = t["completion_mask"]
    # on-policy: w = exp(logp - sg(logp)) = 1, ∇w = ∇logp; dapo divides by every active token of the step
    loss = (-(adv[:, None] * torch.exp(logps - logps.detach())) * mask).sum() / mask.sum()
    loss.backward()
    grads = {n: p.grad for n, p in ref.named_parameters()}
    worst = max((((before[n] - after[n]) / SGD_LR - grads[n]).abs().max().item(), n) for n in grads)
    scale = max(g.abs().max().item() for g in grads.values())
    return {
        "max_abs_diff": worst[0],
        "worst_param": worst[1],
        "max_grad": scale,
        "loss": metrics["loss"],
        "ref_loss": loss.item(),
    }


@check("zero2")
def _():
    """ZeRO-2 works too (HF generation; optimizer states sharded, parameters whole on every rank)."""
    z2_args = GRPOConfig(
        output_dir=os.path.join(OUT, "zero2_run"),
        max_steps=2,
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=6,
        use_vllm=False,
        gradient_checkpointing=False,
        learning_rate=1e-2,
        logging_steps=1,
        deepspeed="zero2.json",
    )
    z2 = GRPOTrainer(tiny_model("qwen2"), digit_fraction, args=z2_args, train_dataset=prompts)
    before = [p.detach().clone() for p in z2.policy.module.parameters()]
    z2.train()
    moved = max((p.detach() - b).abs().max().item() for p, b in zip(z2.policy.module.parameters(), before))
    return {
        "steps": z2.state.global_step,
        "moved": moved,
        "loss": [h["loss"] for h in training_rows(z2)],
        "stage": z2.policy.engine.zero_optimization_stage(),
    }


with open(os.path.join(OUT, f"result-{rank}.json"), "w") as fh:
    json.dump(results, fh)
dist.barrier("results written")

from dsgrpo.process_exit import leave  # noqa: E402

leave(0)  # out without the interpreter's teardown (dsgrpo/process_exit.py): 2.5 s a rank
