"""Run under `torchrun --nproc_per_node 2`: MoE routing replay (issue 31) on real DeepSpeed ZeRO-3, tiny local
Qwen3-MoE / Qwen2-MoE policies sampled by their own generate (use_vllm=False). Each check records numbers in
OUT/result-<rank>.json; tests/test_routing_dist.py asserts.

Every forward's experts are watched from outside dsgrpo: a pre-hook on each layer's experts module compares the
expert indices it is handed with the routes the forward was given (RoutingTap.use, wrapped here).

Usage: torchrun --nproc_per_node 2 tests/dist_scripts/routing_checks.py OUT [CHECK,CHECK,...]
"""

import json
import os
import sys

from datasets import Dataset

from dsgrpo import GRPOTrainer, dist
from dsgrpo.engines import routing
from dsgrpo.testing import tiny_model
from recorder import check_config, SHARDED_ZERO3, digit_fraction, policy_logps, recorder, training_rows

OUT = sys.argv[1]
ONLY = set(sys.argv[2].split(",")) if len(sys.argv) > 2 else None
results, KEEP = {}, []
check = recorder(results, ONLY)
prompts = Dataset.from_list([{"prompt": f"Write some numbers {i}:"} for i in range(32)])


config = check_config(
    OUT,
    max_steps=3,
    max_completion_length=8,
    learning_rate=5e-3,
    seed=9,
    deepspeed=SHARDED_ZERO3,
    use_vllm=False,
    routing_replay="rollout",
)


class ExpertsWatch:
    """Pre-hooks on every experts module of a model: for each call with given routes, the (token, layer) routes whose
    experts differ from the given ones (where given), and how many were checked."""

    def __init__(self, engine):
        core = engine.module
        self.tap = routing.tap_of(engine)
        self.checked = self.differed = self.calls = 0
        experts = [m for m in core.modules() if type(m).__name__.endswith("MoeExperts")]
        assert len(experts) == self.tap.layers, (len(experts), self.tap.layers)
        for layer, module in enumerate(experts):
            module.register_forward_pre_hook(self._hook(layer))

    def _hook(self, layer):
        def hook(module, args):
            given = self.tap._given
            if given is None:
                return
            self.calls += 1
            index, given = args[1], given[:, layer, :]
            known = (given >= 0).all(-1)
            same = (index.sort(-1).values == given.sort(-1).values).all(-1)
            self.checked += int(known.sum())
            self.differed += int((known & ~same).sum())

        return hook


def routers(engine) -> dict:
    """Every router's full weight (gathered from ZeRO-3's shards)."""
    import deepspeed

    params = [(n, p) for n, p in engine.module.named_parameters() if n.endswith("mlp.gate.weight")]
    with deepspeed.zero.GatheredParameters([p for _, p in params]):
        return {n: p.detach().float().clone() for n, p in params}


def run(name, model="qwen3-moe", **overrides):
    peft = overrides.pop("peft", None)
    t = GRPOTrainer(
        tiny_model(model), digit_fraction, train_dataset=prompts, peft_config=peft, args=config(name, **overrides)
    )
    KEEP.append(t)
    watch = ExpertsWatch(t.policy.engine)
    ref_watch = ExpertsWatch(t.reference) if t.reference is not None else None
    before = routers(t.policy.engine)
    t.train()
    after = routers(t.policy.engine)
    rows = training_rows(t)
    keys = (
        "moe/router_agreement",
        "moe/router_own_agreement",
        "moe/tokens_routed_as_sampled",
        "moe/sampling_logp_difference/routes_agreed",
        "moe/sampling_logp_difference/routes_differed",
        "sampling/sampling_logp_difference/mean",
        "sampling/sampling_logp_difference/max",
        "grad_norm",
        "kl",
    )
    return {
        "history": [{k: h[k] for k in keys if k in h} for h in rows],
        "checked": watch.checked,
        "differed": watch.differed,
        "calls": watch.calls,
        "ref_checked": ref_watch.checked if ref_watch else None,
        "ref_differed": ref_watch.differed if ref_watch else None,
        "router_moved": {n: float((after[n] - before[n]).abs().max()) for n in before},
        "budget": None if t.budget is None else t.budget.tokens,
        "replace": routing.tap_of(t.policy.engine).replace,
        "sp": None if t.budget is None or t.budget.sp is None else t.budget.sp.size,
    }


# ------------------------------------------------------------------ replay on padded and packed rows, fp32
@check("fp32")
def _():
    from peft import LoraConfig

    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], lora_dropout=0.0)
    return {
        # padded micro-batches, the reference and old-policy passes replayed too, recomputation in the backward
        "padded": run("padded", token_budget=0, beta=0.05, num_iterations=2, gradient_checkpointing=True),
        "packed_qwen2": run("packed_qwen2", model="qwen2-moe"),  # packed rows (token_budget auto)
        "lora": run("lora", peft=lora, learning_rate=5e-2),
        # sequence parallelism: both ranks run each packed step on two shards, each replaying its tokens' routes;
        # beta > 0, so the reference's sharded pass too
        "sp": run("sp", beta=0.05, parallelism_config={"sp_backend": "deepspeed", "sp_size": 2}),
    }


# ------------------------------------------------------------------ bf16: the sampler and the trainer disagree
@check("bf16")
def _():
    bf16 = {**SHARDED_ZERO3, "bf16": {"enabled": "auto"}}
    return {
        mode: run(
            f"bf16_{mode}",
            bf16=True,
            deepspeed=bf16,
            routing_replay=mode,
            token_budget=0,
            max_steps=3,
            per_device_train_batch_size=16,
            max_completion_length=24,
        )
        for mode in ("off", "rollout")
    }


# ------------------------------------------------------------------ resume with replay on
@check("resume")
def _():
    """A: 4 steps with a checkpoint at 2; B: resumed from it to 4. Each round's routes come from that round's
    sampling, so B replays what A replayed and ends with A's weights."""
    whole = run("resume_whole", max_steps=4, save_steps=2)
    final_whole = policy_logps(KEEP[-1].policy.engine)
    ckpt = os.path.join(OUT, "resume_whole", "checkpoint-2")
    resumed = run("resume_tail", max_steps=4, save_steps=2, resume_from_checkpoint=ckpt)
    final_resumed = policy_logps(KEEP[-1].policy.engine)
    return {"whole": whole, "resumed": resumed, "final_whole": final_whole, "final_resumed": final_resumed}


# ------------------------------------------------------------------ refusals before any model loads
@check("refusals")
def _():
    out = {}
    for name, kwargs in {"dense": dict(model="qwen2"), "vllm": dict(use_vllm=True)}.items():  # CPU: vLLM cannot capture
        model = kwargs.pop("model", "qwen3-moe")
        try:
            GRPOTrainer(
                tiny_model(model), digit_fraction, train_dataset=prompts, args=config(f"refused_{name}", **kwargs)
            )
            out[name] = "accepted"
        except ValueError as exc:
            out[name] = str(exc)
    return out


with open(os.path.join(OUT, f"result-{dist.rank()}.json"), "w") as fh:
    json.dump(results, fh, default=str)
dist.barrier("results written")

from dsgrpo.process_exit import leave  # noqa: E402

leave(0)  # out without the interpreter's teardown (dsgrpo/process_exit.py): 2.5 s a rank
