"""Per-token log-probabilities of completions under a (possibly ZeRO-3 sharded) causal LM.

The model runs up to its last hidden states only; the output head is applied here, a chunk of completion tokens at
a time, and each chunk is reduced at once to what the loss needs (the sampled token's log-prob = its logit minus the
log-sum-exp: a selective log-softmax; the entropy; the untruncated log-prob). So neither the [B, T, V] fp32 logits
nor a log-softmax copy of them ever exist whole: with Qwen2.5's 151,936-token vocabulary and 8 × 1,024 completion
tokens each would be ≈ 5 GB per micro-batch. When a micro-batch needs more than one chunk, each chunk is recomputed
in backward (activation checkpointing of the head alone), so backward holds one chunk's logits too."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch.utils.checkpoint import checkpoint

from ..algorithms import Truncation, entropy_from_logits, truncate_logits
from . import routing

# fp32 bytes of one chunk's logits (auto chunking): 256 MiB is 441 tokens of a 151,936-token vocabulary
CHUNK_LOGIT_BYTES = 256 * 2**20


@dataclass
class Forward:
    logps: torch.Tensor  # [B, T] log-probs of the completion tokens (truncated as the sampler did)
    entropy: Optional[torch.Tensor]  # [B, T], when asked
    full_logps: Optional[torch.Tensor]  # [B, T] untruncated log-probs, when asked (the KL term's)
    aux_loss: Optional[torch.Tensor]  # a MoE router's load-balancing loss, when asked
    # MoE with the sampler's routes: per scored token (as logps), whether the state predicting it was routed as the
    # sampler routed it in every layer; and RoutingTap.pop_counts() of the whole forward
    routes_agreed: Optional[torch.Tensor] = None
    route_counts: Optional[tuple] = None


def chunk_tokens_for(vocab_size: int, chunk_tokens: int = 0) -> int:
    """Completion tokens per head chunk: `chunk_tokens`, or (0) as many as fit CHUNK_LOGIT_BYTES of fp32 logits."""
    return chunk_tokens if chunk_tokens > 0 else max(1, CHUNK_LOGIT_BYTES // (4 * vocab_size))


def policy_forward(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_len: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    truncation: Optional[Truncation] = None,
    with_full: bool = False,
    router_aux: bool = False,
    chunk_tokens: int = 0,
    routes: Optional[torch.Tensor] = None,
) -> Forward:
    """One forward of `model` over prompt + completion, scored on the last `completion_len` tokens of each row.

    input_ids / attention_mask: [B, P+T] with left-padded prompts followed by right-padded completions. Logits are
    divided by the sampling temperature and truncated as the sampler truncates them (`truncation`: top_k / top_p /
    min_p), so the log-probs are of the distribution the sampler drew from (vLLM's processed logprobs).
    `entropy_grad`: the entropies keep their graph (an entropy bonus in the loss). `router_aux`: a MoE model also
    returns its router's load-balancing loss. Padding positions of the completions score 0 (they are not computed).
    `chunk_tokens`: completion tokens per head chunk (0: chunk_tokens_for's budget). `routes` [B, P+T, layers, k]:
    a MoE model's sampler routes, replayed or compared (engines/routing.py)."""
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    T = completion_len
    # logits_to_keep: the head's input is the T+1 positions that predict the completion (and its end)
    states, head, softcap, aux, agreed = _final_states(
        model, input_ids, attention_mask, position_ids, T + 1, router_aux, routes
    )
    states = states[:, -T - 1 : -1, :]  # [B, T, H]: the states predicting them
    targets = input_ids[:, -T:]
    real = attention_mask[:, -T:].bool()  # completion tokens, not padding
    score = _ChunkScore(
        head, softcap, temperature, truncation, with_entropy, entropy_grad and torch.is_grad_enabled(), with_full
    )
    parts = score.all(states[real], targets[real], chunk_tokens_for(head.out_features, chunk_tokens))
    # back to [B, T], padding 0
    logps, entropy, full = (None if p is None else p.new_zeros(real.shape).masked_scatter(real, p) for p in parts)
    if with_full and full is None:
        full = logps
    if agreed is not None:
        agreed = (agreed[0].view(input_ids.shape)[:, -T - 1 : -1] & real, agreed[1])
    return Forward(logps, entropy, full, aux, *(agreed or (None, None)))


def packed_forward(
    model,
    step,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    truncation: Optional[Truncation] = None,
    with_full: bool = False,
    router_aux: bool = False,
    chunk_tokens: int = 0,
    sp=None,
    owner: Optional[int] = None,
) -> Forward:
    """policy_forward over a packed step (layout.PackedStep: whole sequences end to end in each row, position ids
    restarting per sequence, no attention mask, so transformers keeps attention inside each sequence). Returns
    flat [n] values in the step's score order. A stand-in step (nothing scored) scores its one token so the
    backward still reaches every parameter, as every rank's must under ZeRO-3; the caller gives it weight 0.

    `sp`: a sequence-parallel group runs member `owner`'s step together, each rank on its shard
    (sequence_parallel.py); the owner gets the [n] values, the other members empty ones that still carry the
    graph (their loss is 0 times them, so their backward runs too)."""
    if sp is not None:
        return _sharded_packed_forward(
            model,
            step,
            sp,
            owner,
            temperature,
            with_entropy,
            entropy_grad,
            truncation,
            with_full,
            router_aux,
            chunk_tokens,
        )
    states, head, softcap, aux, agreed = _final_states(
        model, step.input_ids, None, step.position_ids, 0, router_aux, getattr(step, "routes", None)
    )
    flat = states.reshape(-1, states.shape[-1])
    at, targets = (
        (step.score_at, step.targets)
        if not step.empty
        else (torch.zeros(1, dtype=torch.long), step.input_ids.reshape(-1)[:1])
    )
    score = _ChunkScore(
        head, softcap, temperature, truncation, with_entropy, entropy_grad and torch.is_grad_enabled(), with_full
    )
    logps, entropy, full = score.all(
        flat[at.to(flat.device)], targets.to(flat.device), chunk_tokens_for(head.out_features, chunk_tokens)
    )
    if with_full and full is None:
        full = logps
    if agreed is not None:
        agreed = (agreed[0][at], agreed[1])
    return Forward(logps, entropy, full, aux, *(agreed or (None, None)))


def _sharded_packed_forward(
    model, step, sp, owner, temperature, with_entropy, entropy_grad, truncation, with_full, router_aux, chunk_tokens
) -> Forward:
    from .. import dist, sequence_parallel

    piece = sequence_parallel.shard(step, sp)
    with sequence_parallel.sharded_forward():  # a MoE step's routes are cut with its tokens: each shard replays its own
        states, head, softcap, aux, agreed = _final_states(
            model, piece.input_ids, None, piece.position_ids, 0, router_aux, piece.routes
        )
    flat = states.reshape(-1, states.shape[-1])
    # this shard's scored tokens, then a keep-alive (its first position) that ToOwner neither sends nor weighs
    at = torch.cat([piece.score_at, torch.zeros(1, dtype=torch.long)])
    targets = torch.cat([piece.targets, piece.input_ids.reshape(-1)[:1]])
    score = _ChunkScore(
        head, softcap, temperature, truncation, with_entropy, entropy_grad and torch.is_grad_enabled(), with_full
    )
    parts = score.all(
        flat[at.to(flat.device)], targets.to(flat.device), chunk_tokens_for(head.out_features, chunk_tokens)
    )
    present = [p for p in parts if p is not None]
    if agreed is not None:  # whether each scored token's state was routed as sampled travels to the owner with it
        present.append(agreed[0][at].to(present[0].device, present[0].dtype))
    values = sequence_parallel.ToOwner.apply(
        torch.stack(present, dim=1), piece.counts, sp.rank, owner, dist.sequence_parallel_rank_of(0)
    )
    columns = iter(values.unbind(1))
    logps, entropy, full = (next(columns) if p is not None else None for p in parts)
    if with_full and full is None:
        full = logps
    if agreed is not None:  # the step's route counts are its shards' (the same collective on every member)
        counts = dist.all_reduce_sum(torch.tensor(agreed[1], dtype=torch.long), group=dist.SP)
        agreed = (next(columns).detach() > 0.5, tuple(int(c) for c in counts))
    return Forward(logps, entropy, full, aux, *(agreed or (None, None)))


@torch.no_grad()
def packing_leak(model, vocab_size: int) -> float:
    """How much a packed row's second sequence depends on the first: the largest change in its final hidden
    states when the first sequence's tokens change, relative to their scale. 0 when the model's attention honours
    the packed-sequence layout (position ids restarting, no mask: transformers' block-diagonal masks for sdpa/eager,
    flash-attention's varlen path), since masked scores contribute exact zeros whatever the dtype; O(0.01..1) when
    its attention spans the whole row (OPT, Falcon, Bloom in transformers 5, a custom model), which would train
    every packed token on its neighbours' context, silently. Every rank holding a share of a ZeRO-3 model must
    call it together (each forward gathers)."""
    g = torch.Generator().manual_seed(0)
    firsts = [torch.randint(0, max(2, vocab_size), (1, 7), generator=g) for _ in range(2)]
    second = torch.randint(0, max(2, vocab_size), (1, 5), generator=g)
    positions = torch.cat([torch.arange(7), torch.arange(5)]).unsqueeze(0)
    training = model.training
    model.eval()  # no dropout: the two forwards must differ only in the first sequence's tokens
    try:
        a, b = (
            _final_states(model, torch.cat([first, second], dim=1), None, positions, 0, False)[0][0, 7:].float()
            for first in firsts
        )
    finally:
        model.train(training)
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-6))


def _final_states(
    model,
    input_ids,
    attention_mask,
    position_ids,
    logits_to_keep: int,
    router_aux: bool,
    routes: Optional[torch.Tensor] = None,
):
    """The model's last hidden states (of its last `logits_to_keep` positions; 0: all), its head, the head's soft
    cap, (router_aux) the router's load-balancing loss, and with `routes` (laid out as input_ids, then layers and
    k) ([tokens] whether every layer agreed with them, (agreed, compared)). The head runs on one position only."""
    extra = {"output_router_logits": True} if router_aux else {}
    head, hidden, softcap = _head_and_hidden(model)
    device = next(iter(head.parameters())).device
    with hidden, routing.routed(model, routes) as tap:
        out = model(
            input_ids=input_ids.to(device),
            attention_mask=None if attention_mask is None else attention_mask.to(device),
            position_ids=position_ids.to(device),
            logits_to_keep=logits_to_keep,
            use_cache=False,
            **extra,
        )
    _check_plain_head(model, head, softcap, hidden.states[:, -1:, :], out.logits)
    agreed = None
    if tap is not None and tap.token_agreed is not None:
        agreed = (tap.token_agreed.cpu(), tap.pop_counts())
    return hidden.states, head, softcap, getattr(out, "aux_loss", None) if router_aux else None, agreed


def completion_logprobs(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_len: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    truncation: Optional[Truncation] = None,
    chunk_tokens: int = 0,
    routes: Optional[torch.Tensor] = None,
):
    """(log-probs [B, T], entropies [B, T] or None): policy_forward's two usual results."""
    f = policy_forward(
        model,
        input_ids,
        attention_mask,
        completion_len,
        temperature,
        with_entropy,
        entropy_grad,
        truncation,
        chunk_tokens=chunk_tokens,
        routes=routes,
    )
    return f.logps, f.entropy


# ------------------------------------------------------------------------------------------------- the head, chunked
class _ChunkScore:
    """The head applied to [N, H] states a chunk at a time; returns [N] log-probs, entropies, untruncated log-probs."""

    def __init__(self, head, softcap, temperature, truncation, with_entropy, entropy_grad, with_full):
        self.head, self.softcap, self.temperature = head, softcap, temperature
        self.truncation = truncation if truncation is not None and truncation.active else None
        self.with_entropy, self.entropy_grad = with_entropy, entropy_grad
        self.with_full = with_full and self.truncation is not None  # untruncated == truncated otherwise

    def all(self, states: torch.Tensor, targets: torch.Tensor, chunk: int):
        n = states.shape[0]
        recompute = torch.is_grad_enabled() and n > chunk  # one chunk: nothing to save by recomputing it
        outs = []
        for start in range(0, max(n, 1), chunk):
            s, t = states[start : start + chunk], targets[start : start + chunk]
            if recompute:
                outs.append(checkpoint(self.one, s, t, use_reentrant=False))
            else:
                outs.append(self.one(s, t))
        return [torch.cat([o[i] for o in outs]) if outs[0][i] is not None else None for i in range(3)]

    def one(self, states: torch.Tensor, targets: torch.Tensor):
        logits = soft_capped(self.head(states).float(), self.softcap) / self.temperature  # [n, V]
        sampled = logits if self.truncation is None else truncate_logits(logits, self.truncation, keep=targets)
        logps = _selected_logps(sampled, targets)
        entropy = full = None
        if self.with_entropy:
            with torch.set_grad_enabled(self.entropy_grad):
                entropy = entropy_from_logits(sampled)
        if self.with_full:
            full = _selected_logps(logits, targets)
        return logps, entropy, full


def soft_capped(logits: torch.Tensor, cap: Optional[float]) -> torch.Tensor:
    """Gemma 2's final logit soft-capping, cap · tanh(logits / cap), which its model applies after the head."""
    return logits if not cap else cap * torch.tanh(logits / cap)


def _selected_logps(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits)[target] without the log-softmax's [n, V] copy: the target's logit minus the log-sum-exp."""
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


class _HiddenStates:
    """Takes the output head's input during one forward and hands it only the last position, so the model computes
    a single position's logits (for _check_plain_head) and its final hidden states stay here for chunking."""

    def __init__(self, head):
        self.head, self.states, self._handle = head, None, None

    def _take(self, module, args):
        self.states = args[0]
        return (args[0][:, -1:, :],) + tuple(args[1:])

    def __enter__(self):
        self._handle = self.head.register_forward_pre_hook(self._take)
        return self

    def __exit__(self, *exc):
        self._handle.remove()


def _head_and_hidden(model):
    core = getattr(model, "module", model)  # a DeepSpeed engine's module
    if hasattr(core, "get_base_model"):  # a peft model
        core = core.get_base_model()
    head = core.get_output_embeddings()
    if head is None or not isinstance(head, torch.nn.Linear):
        raise TypeError(
            f"{type(core).__name__} has no linear output head (get_output_embeddings()); dsgrpo trains "
            "causal language models with one."
        )
    softcap = getattr(getattr(core, "config", None), "final_logit_softcapping", None)
    return head, _HiddenStates(head), softcap


_checked_heads = set()


def _check_plain_head(model, head, softcap, last_states: torch.Tensor, model_logits: torch.Tensor) -> None:
    """The model's logits must be its head's output (soft-capped where its config says final_logit_softcapping): a
    model that transforms them otherwise after the head (Cohere's logit scale) would be scored wrongly by the
    chunks. Checked on the first forward of a model, on the one position the model computed."""
    if id(model) in _checked_heads:
        return
    with torch.no_grad():
        ours = soft_capped(head(last_states.detach()).float(), softcap)
    theirs = model_logits.detach().float()
    if not torch.allclose(ours, theirs, rtol=1e-3, atol=1e-3):
        raise NotImplementedError(
            f"{type(getattr(model, 'module', model)).__name__} changes its logits after the "
            "output head (a scaling other than final_logit_softcapping); dsgrpo's chunked "
            "log-probs apply the head alone and do not support it yet."
        )
    _checked_heads.add(id(model))
