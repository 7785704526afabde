"""Sequence parallelism for the training side of a step: DeepSpeed's Ulysses attention (ALST) over groups of N
consecutive ranks.

Each rank keeps its own rows and its own loss, exactly as without sequence parallelism. What a group shares is the
forward: every packed step (layout.PackedStep) of each member is run by the whole group, one member's step at a
time, each rank holding 1/N of that step's tokens (its rows laid end to end as one row, cut in N). The model's
attention runs through DeepSpeed's UlyssesSPAttentionHF: an all-to-all turns sequence shards into head shards, the
core attention sees the whole row for its heads (causal sdpa on each packed sequence of it, found from the gathered
position ids; flash-attention's varlen path reads them itself), and a second all-to-all turns
the result back. Everything else in the model works token by token. Each rank then scores the completion tokens
that fall in its shard (log-prob, entropy, untruncated log-prob, chunked as ever) and the member whose step it is
receives them all; in backward every shard gets the gradient of its own tokens back.

So one member's step costs each rank 1/N of its activations, every loss normaliser keeps its per-rank meaning, and
the gradient summed over the world is data parallelism's Σ over ranks of each rank's loss, which ZeRO averages over
the world as before: sequence parallelism changes where a token is computed, not what is learned."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional

import torch

from . import compat, dist

SUPPORTED_ATTENTION = ("sdpa", "flash_attention_2", "flash_attention_3")


@dataclass
class SequenceParallel:
    size: int  # N: ranks in a group
    rank: int  # this rank's place in its group (0..N-1)
    group: Any  # the torch.distributed group
    pad_id: int  # the token that pads a step's row to a multiple of N

    def share(self, obj) -> List:
        """Every member's `obj`, in member order (one collective over the group)."""
        return dist.all_gather_object(obj, group=dist.SP)


# --------------------------------------------------------------------------------------------------- the knob
def requested_size(args, ds_config: Optional[dict]) -> int:
    """N from `parallelism_config` (transformers' field: an Accelerate ParallelismConfig or its dict, with
    sp_backend "deepspeed" and sp_size) or the DeepSpeed config's `sequence_parallel_size`; 1 when neither asks."""
    sizes = {}
    pc = args.parallelism_config
    if pc is not None:
        get = pc.get if isinstance(pc, dict) else (lambda key, default=None: getattr(pc, key, default))
        for key in ("cp_size", "tp_size"):
            if int(get(key, 1) or 1) > 1:
                raise ValueError(
                    f"parallelism_config.{key}={get(key)}: dsgrpo shards the training sequence with "
                    "DeepSpeed's Ulysses (sp_size, sp_backend='deepspeed'); set "
                    f"{key}=1 (vLLM's tensor parallelism is vllm_tensor_parallel_size)."
                )
        sp = int(get("sp_size", 1) or 1)
        if sp > 1:
            backend = get("sp_backend", "deepspeed") or "deepspeed"
            if backend != "deepspeed":
                raise ValueError(
                    f"parallelism_config.sp_backend={backend!r}: dsgrpo's sequence parallelism is "
                    "DeepSpeed's Ulysses; set sp_backend='deepspeed'."
                )
            sizes["parallelism_config.sp_size"] = sp
    ds = int((ds_config or {}).get("sequence_parallel_size", 1) or 1)
    if ds > 1:
        sizes["the DeepSpeed config's sequence_parallel_size"] = ds
    if len(set(sizes.values())) > 1:
        raise ValueError(f"Two sequence-parallel sizes: {sizes}. Set one (or both to the same value).")
    return next(iter(sizes.values()), 1)


def check(size: int, args, world: int, model_config, split: bool) -> None:
    """Refuse, before any model loads, what sequence parallelism of `size` cannot run here, naming the fix."""
    if size <= 1:
        return
    if world % size:
        raise ValueError(
            f"sequence parallelism of {size} needs a world divisible by it; this run has {world} "
            f"ranks. Use a divisor of {world}."
        )
    text = model_config.get_text_config()
    heads = text.num_attention_heads
    kv = getattr(text, "num_key_value_heads", None) or heads
    if heads % size or not (kv % size == 0 or size % kv == 0):
        raise ValueError(
            f"sequence parallelism of {size}: Ulysses shards the attention heads, and the model has "
            f"{heads} query and {kv} key/value heads (each must divide by {size}, or {size} by the "
            "key/value heads). Choose a size that divides them."
        )
    if args.token_budget is not None and args.token_budget <= 0:
        raise ValueError(
            "sequence parallelism shards packed steps: token_budget=0 (padded micro-batches) cannot "
            "be combined with it. Leave token_budget unset (None) or set a budget."
        )
    if split:
        raise NotImplementedError(
            "sequence parallelism with async_placement='split' is not supported yet: use async_placement='colocate'."
        )


def start(size: int, model_config, pad_id: int) -> Optional[SequenceParallel]:
    """The groups (every rank calls this, collectively) and the attention wrapper, once the policy is loaded
    (its config names the attention it resolved); None for size 1."""
    if size <= 1:
        return None
    text = model_config.get_text_config()
    impl = getattr(text, "_attn_implementation", None) or getattr(model_config, "_attn_implementation", None)
    if impl not in SUPPORTED_ATTENTION:
        raise ValueError(
            f"sequence parallelism needs attn_implementation in {SUPPORTED_ATTENTION}; the model uses "
            f"{impl!r}. Set model_init_kwargs={{'attn_implementation': 'sdpa'}} (or a flash-attention)."
        )
    group = dist.sequence_parallel_groups(size)
    sp = SequenceParallel(size, dist.rank(dist.SP), group, pad_id)
    _install_attention(impl, model_config, group)
    return sp


def each_member(steps: List, sp: Optional[SequenceParallel]):
    """(owner, step) in the order the group runs them: for each of this rank's steps, every member's step of the
    same index (owner: its member; None without sequence parallelism, where each rank runs its own)."""
    if sp is None:
        for step in steps:
            yield None, step
        return
    members = sp.share(steps)
    for i in range(len(steps)):
        for m in range(sp.size):
            yield m, members[m][i]


# --------------------------------------------------------------------------------------------------- attention
_sharded = [0]  # depth of sharded_forward contexts: while > 0 the models' attention runs through Ulysses
_installed = {}  # attention name → (the original function, the Ulysses module, its group)


class sharded_forward:
    """While inside, the models' attention runs through Ulysses; outside (generation with transformers, reward
    models, evaluation), the original function runs unchanged. Process-wide, not per thread: on GPU the backward
    (and gradient checkpointing's recomputation in it) runs on autograd's device threads, so a training micro-step
    holds it over its forward and backward. Nothing generates with transformers while a step trains (the
    asynchronous trainer generates with vLLM only)."""

    def __enter__(self):
        _sharded[0] += 1

    def __exit__(self, *exc):
        _sharded[0] -= 1


def sharded(fn):
    """`fn` run inside sharded_forward."""

    def run(*args, **kwargs):
        with sharded_forward():
            return fn(*args, **kwargs)

    return run


def _install_attention(name: str, model_config, group) -> None:
    if name in _installed and _installed[name][2] is group:
        return
    original = _installed[name][0] if name in _installed else compat.attention_function(name)
    core = original if name.startswith("flash") else _block_causal(original)
    ulysses = compat.ulysses_attention(core, model_config, group)

    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        if not _sharded[0]:
            return original(module, query, key, value, attention_mask, *args, **kwargs)
        return ulysses(module, query, key, value, None, *args, **kwargs)

    compat.replace_attention_function(name, attention)
    _installed[name] = (original, ulysses, group)


def _block_causal(sdpa):
    """sdpa over the whole gathered row that keeps each packed sequence to itself (sequences start where position
    ids restart at 0): causal sdpa on each sequence's slice, which stays on the fused O(L) kernels; a block-diagonal
    mask over the row would take sdpa's O(L²) math path (measured: SP 2 then peaked above SP 1 at 8k tokens)."""

    def attention(module, query, key, value, attention_mask, *args, position_ids=None, **kwargs):
        starts = (position_ids[0] == 0).nonzero().flatten().tolist()
        if starts[:1] != [0]:
            starts = [0] + starts
        bounds = starts + [query.shape[2]]
        if len(bounds) == 2:
            return sdpa(module, query, key, value, None, *args, **kwargs)
        outs = [
            sdpa(module, query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], None, *args, **kwargs)[0]
            for a, b in zip(bounds[:-1], bounds[1:])
        ]
        return torch.cat(outs, dim=1), None  # transformers' attention returns [batch, length, heads, head_dim]

    return attention


# --------------------------------------------------------------------------------------------------- a shard
@dataclass
class Shard:
    """This rank's piece of one member's packed step, laid out as one row."""

    input_ids: torch.Tensor  # [1, S]
    position_ids: torch.Tensor  # [1, S]
    score_at: torch.Tensor  # [k] positions in the shard whose states predict scored tokens
    targets: torch.Tensor  # [k]
    counts: List[int]  # every member's k, in member order (the owner's [n] is their concatenation)
    routes: Optional[torch.Tensor] = None  # [1, S, layers, k]: a MoE sampler's routes of the shard's tokens (-1: pad)


def shard(step, sp: SequenceParallel) -> Shard:
    """The step's rows end to end, padded to a multiple of N (the padding a sequence of its own), and this rank's
    N-th of it. Scored positions ascend along the row, so each rank's are a contiguous run of the step's score
    order and the owner's values are the members' runs concatenated. A MoE step's routes are cut with its tokens."""
    ids, pos = step.input_ids.reshape(-1), step.position_ids.reshape(-1)
    routes = getattr(step, "routes", None)
    n, N = ids.numel(), sp.size
    S = -(-n // N)
    pad = S * N - n
    if routes is not None:
        routes = routes.reshape(n, *routes.shape[-2:])
    if pad:
        ids = torch.cat([ids, torch.full((pad,), sp.pad_id, dtype=ids.dtype)])
        pos = torch.cat([pos, torch.arange(pad, dtype=pos.dtype)])
        if routes is not None:  # the padding routes on its own
            routes = torch.cat([routes, routes.new_full((pad, *routes.shape[1:]), -1)])
    at = step.score_at if not step.empty else torch.zeros(0, dtype=torch.long)
    targets = step.targets if not step.empty else torch.zeros(0, dtype=torch.long)
    bounds = torch.arange(N + 1) * S
    counts = [int(((at >= bounds[r]) & (at < bounds[r + 1])).sum()) for r in range(N)]
    lo, hi = int(bounds[sp.rank]), int(bounds[sp.rank + 1])
    mine = (at >= lo) & (at < hi)
    return Shard(
        ids[lo:hi].unsqueeze(0),
        pos[lo:hi].unsqueeze(0),
        at[mine] - lo,
        targets[mine],
        counts,
        None if routes is None else routes[lo:hi].unsqueeze(0),
    )


class ToOwner(torch.autograd.Function):
    """[k, c] values of this rank's shard → the owner's [n, c] (the members' runs concatenated; an empty [0, c] on
    the others). Backward hands each member the gradient of its own run. The last row of `local` is a keep-alive
    (a token scored only so every rank's backward reaches the output head, as ZeRO-3 needs): it is not sent and
    its gradient is 0."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, counts: List[int], member: int, owner: int, group_first: int):
        ctx.counts, ctx.member, ctx.owner, ctx.first = counts, member, owner, group_first
        longest = max(max(counts), 1)
        padded = local.new_zeros((longest, local.shape[1]))
        padded[: counts[member]] = local[: counts[member]].detach()
        gathered = dist.all_gather(padded.unsqueeze(0), group=dist.SP)  # [N, longest, c]
        if member != owner:
            return local.new_zeros((0, local.shape[1]))
        return torch.cat([gathered[r, :k] for r, k in enumerate(counts)])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        counts, longest = ctx.counts, max(max(ctx.counts), 1)
        c = grad.shape[1]
        runs = grad.new_zeros((len(counts), longest, c))
        if ctx.member == ctx.owner:
            at = 0
            for r, k in enumerate(counts):
                runs[r, :k] = grad[at : at + k]
                at += k
        dist.broadcast(runs, src=ctx.first + ctx.owner, group=dist.SP)
        mine = runs[ctx.member, : counts[ctx.member]]
        return torch.cat([mine, grad.new_zeros((1, c))]), None, None, None, None
