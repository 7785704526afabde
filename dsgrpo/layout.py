"""How a round's sequences are laid out for the forwards of a step: padded micro-batches, or packed token-budget steps.

Padded (token_budget <= 0): each micro-batch of per_device_train_batch_size completions is one [B, P+T] forward,
padded to its longest row: one long completion makes the whole micro-batch pay for its length.

Packed (token_budget > 0): whole sequences (prompt + completion, padding removed) are laid end to end in rows
with position ids restarting at each sequence, so transformers' packed-sequence masks keep attention inside a
sequence (sdpa/eager build a block-diagonal causal mask from the position ids; flash-attention takes the varlen
path). A row is at most as long as the longest sequence of the step, so a row's attention never costs more than
a padded row's would; a step is as many rows as fit `token_budget` tokens (rows x the step's row length), and the
steps of a group are balanced by a cost that counts attention (sum of L + L^2 / ATTENTION_WIDTH per sequence).
Every rank runs the same number of steps per group (a step with nothing to train is a one-token forward whose loss
has weight 0): ZeRO-3 gathers parameters collectively in every forward and backward, so uneven counts would hang.

The loss never learns how rows were built: a packed step hands back its sequences' per-token values as
[S, T] rows (`PackedStep.rows`) next to the same rows of the round's logical micro-batches (`PackedStep.gather`),
and `scatter` writes per-token results back into the logical [B, T] tensors."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence as Seq

import torch

from . import dist

ATTENTION_WIDTH = 6  # per sequence cost: L + L^2 / (ATTENTION_WIDTH * hidden): attention's share next to the layers'


@dataclass(frozen=True)
class TokenBudget:
    """A run's packed layout: at most `tokens` tokens a rank forwards; `hidden` (the model's width) prices attention;
    `sp`: a sequence-parallel group (sequence_parallel.py) runs each step on N shards, so a step holds N x tokens."""

    tokens: int
    hidden: int
    pad_id: int
    sp: Optional[object] = None

    @property
    def step_tokens(self) -> int:
        return self.tokens * (self.sp.size if self.sp is not None else 1)


def resolve_budget(
    token_budget: Optional[int],
    per_device_train_batch_size: int,
    longest_prompt: int,
    max_completion_length: int,
    sp_size: int = 1,
) -> Optional[int]:
    """The run's budget in tokens, or None for padded micro-batches (token_budget <= 0). None plans it: what one
    padded micro-batch of the longest prompt and completion would hold, so the memory planned for a padded
    micro-batch bounds every packed step whatever the lengths. A budget a whole sequence cannot fit is refused
    (with sequence parallelism of `sp_size`, a sequence is cut in that many shards)."""
    longest = longest_prompt + max_completion_length
    if token_budget is None:
        return per_device_train_batch_size * -(-longest // sp_size)
    if token_budget <= 0:
        return None
    if token_budget * sp_size < longest:
        shards = f" in {sp_size} sequence-parallel shards" if sp_size > 1 else ""
        raise ValueError(
            f"token_budget={token_budget} is smaller than the longest sequence this run can make"
            f"{shards}: {longest} tokens (longest prompt {longest_prompt} + max_completion_length "
            f"{max_completion_length}). Raise token_budget to at least {-(-longest // sp_size)}, or set "
            "it to 0 for padded micro-batches."
        )
    return token_budget


@dataclass
class Sequence:
    """One completion of the round with its prompt, padding removed."""

    micro: int  # its logical micro-batch
    row: int  # its row there
    ids: torch.Tensor  # [L] prompt + completion tokens
    prompt_len: int
    completion_len: int  # tokens scored (the completion's real tokens)
    routes: Optional[torch.Tensor] = None  # [L, layers, k]: a MoE sampler's experts per token (engines/routing.py)
    # a piece of its row (Rollout.restarts: part of the completion was sampled after a prompt of its own): the
    # logical columns [column, column + completion_len) it scores; None: the whole row
    column: Optional[int] = None

    @property
    def first(self) -> int:
        return self.column or 0

    @property
    def length(self) -> int:
        return int(self.ids.numel())


def sequences_of(micro: List[dict], which: Optional[Seq[int]] = None) -> List[Sequence]:
    """The sequences of the logical micro-batches `which` (all by default), read from their padded tensors.
    Sequences with nothing to score (an empty completion) are left out: no forward needs them. A row that restarts
    (mb["restarts"], Rollout.restarts) becomes one sequence per piece, each with its own prompt."""
    out = []
    for j in range(len(micro)) if which is None else which:
        mb = micro[j]
        ids, attention = mb["input_ids"], mb["attention_mask"]
        T = mb["completion_mask"].shape[1]
        P = ids.shape[1] - T
        for b in range(ids.shape[0]):
            real = attention[b].bool()
            c = int(attention[b, P:].sum())
            restarts = mb["restarts"][b] if "restarts" in mb else None
            if c and restarts:
                if "routes" in mb:
                    raise ValueError(
                        "a completion that restarts from a prompt of its own (an agent that rewrote "
                        "its history) has no sampler routes for that prompt: set routing_replay='off'."
                    )
                out += _pieces(j, b, ids[b][real], int(attention[b, :P].sum()), c, restarts)
            elif c:
                routes = mb["routes"][b][real] if "routes" in mb else None
                out.append(Sequence(j, b, ids[b][real], int(attention[b, :P].sum()), c, routes))
    return out


def _pieces(
    micro: int, row: int, ids: torch.Tensor, prompt_len: int, completion_len: int, restarts: List[list]
) -> List[Sequence]:
    """A restarting row's sequences: its prompt with the completion up to the first restart, then each restart's
    prompt with the completion up to the next."""
    completion = ids[prompt_len:]
    cuts = [0] + [int(at) for at, _ in restarts] + [completion_len]
    prompts = [ids[:prompt_len]] + [torch.tensor(p, dtype=ids.dtype) for _, p in restarts]
    return [
        Sequence(micro, row, torch.cat([prompt, completion[a:b]]), len(prompt), b - a, column=a)
        for prompt, a, b in zip(prompts, cuts, cuts[1:])
        if b > a
    ]


@dataclass
class PackedStep:
    """One forward of packed rows: [R, N] tensors of whole sequences end to end (the rest of a row is padding that
    forms a sequence of its own and is never scored)."""

    input_ids: torch.Tensor  # [R, N]
    position_ids: torch.Tensor  # [R, N]
    sequences: List[Sequence]  # in the order of their scored tokens
    score_at: torch.Tensor  # [n] flat index (r * N + i) of the state predicting each token
    targets: torch.Tensor  # [n] the scored tokens
    widths: List[int] = field(default_factory=list)  # each sequence's logical width T (its micro-batch's)
    routes: Optional[torch.Tensor] = None  # [R, N, layers, k] the sequences' routes (-1 at padding)

    @property
    def empty(self) -> bool:
        """Nothing to train on: a stand-in forward so every rank runs the same number of steps."""
        return not self.sequences

    @property
    def tokens(self) -> int:
        return int(self.input_ids.numel())

    def rows(self, flat: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """[S, T]: a scored value of each token ([n], in score order) at its sequence's row and column, 0 elsewhere
        (T: the widest logical micro-batch among the step's sequences). Keeps the graph of `flat`."""
        if flat is None:
            return None
        S, T = len(self.sequences), max(self.widths, default=1)
        first = torch.tensor([s.first for s in self.sequences]).unsqueeze(1)
        counts = torch.tensor([s.completion_len for s in self.sequences]).unsqueeze(1)
        columns = torch.arange(T).unsqueeze(0)
        real = (columns >= first) & (columns < first + counts)
        return flat.new_zeros((S, T)).masked_scatter(real, flat)

    def gather(self, per_micro: Optional[List[torch.Tensor]]) -> Optional[torch.Tensor]:
        """[S, T] (or [S] for per-row values): the step's sequences' rows of the logical micro-batches' tensors."""
        if per_micro is None:
            return None
        first = per_micro[self.sequences[0].micro]
        if first.dim() == 1:
            return torch.stack([per_micro[s.micro][s.row] for s in self.sequences])
        T = max(self.widths)
        out = first.new_zeros((len(self.sequences), T))
        for i, s in enumerate(self.sequences):
            row = per_micro[s.micro][s.row]
            if s.column is None:
                out[i, : row.shape[0]] = row
            else:  # a piece: only its own columns (the row's others are scored in its other pieces)
                out[i, s.column : s.column + s.completion_len] = row[s.column : s.column + s.completion_len]
        return out


def scatter(steps: List[PackedStep], values: List[torch.Tensor], shapes: List[torch.Size]) -> List[torch.Tensor]:
    """Per-token results of packed steps ([n] each, in score order) back into the logical micro-batches' [B, T]
    layout (0 at padding)."""
    out = [torch.zeros(shape) for shape in shapes]
    for step, flat in zip(steps, values):
        at = 0
        for s in step.sequences:
            out[s.micro][s.row, s.first : s.first + s.completion_len] = flat[at : at + s.completion_len].to(
                out[s.micro].dtype
            )
            at += s.completion_len
    return out


def sequence_cost(length: int, hidden: int) -> float:
    return length + length * length / (ATTENTION_WIDTH * max(1, hidden))


def _rows(seqs: List[Sequence], row_len: int) -> List[List[Sequence]]:
    """Sequences into rows of at most row_len tokens, first fit by decreasing length."""
    rows, room = [], []
    for s in sorted(seqs, key=lambda s: -s.length):
        for i, r in enumerate(room):
            if s.length <= r:
                rows[i].append(s)
                room[i] -= s.length
                break
        else:
            rows.append([s])
            room.append(row_len - s.length)
    return rows


def plan_steps(
    groups: List[List[Sequence]], budget: int, hidden: int, pad_id: int, widths: List[int], group=None
) -> List[List[PackedStep]]:
    """Each group's sequences packed into steps of at most `budget` tokens, balanced by cost, with the same number of
    steps for each group on every rank (one collective). `widths`: each logical micro-batch's T."""
    packed = []
    for seqs in groups:
        longest = max((s.length for s in seqs), default=1)
        if longest > budget:
            raise ValueError(
                f"A sequence of {longest} tokens (prompt + completion) is longer than token_budget="
                f"{budget}: it cannot be trained on. Raise token_budget to at least {longest}."
            )
        rows = _rows(seqs, longest)
        per_step = max(1, budget // longest)
        packed.append((rows, per_step))
    needed = torch.tensor([math.ceil(len(rows) / per_step) for rows, per_step in packed] or [0], dtype=torch.float64)
    counts = dist.all_reduce_max(needed, group=group).long().tolist() if groups else []
    plan = []
    for (rows, per_step), k in zip(packed, counts):
        k = max(k, 1)
        bins: List[List[List[Sequence]]] = [[] for _ in range(k)]
        load = [0.0] * k
        costed = [(sum(sequence_cost(s.length, hidden) for s in row), row) for row in rows]
        for cost, row in sorted(costed, key=lambda c: -c[0]):  # heaviest first, each to the lightest open step
            i = min((i for i in range(k) if len(bins[i]) < per_step), key=lambda i: load[i])
            bins[i].append(row)
            load[i] += cost
        plan.append([_step(b, pad_id, widths) for b in bins])
    return plan


def _step(rows: List[List[Sequence]], pad_id: int, widths: List[int]) -> PackedStep:
    if not rows:  # a stand-in: one token, nothing scored
        return PackedStep(
            torch.full((1, 1), pad_id, dtype=torch.long),
            torch.zeros((1, 1), dtype=torch.long),
            [],
            torch.zeros(0, dtype=torch.long),
            torch.zeros(0, dtype=torch.long),
        )
    N = max(sum(s.length for s in r) for r in rows)
    input_ids = torch.full((len(rows), N), pad_id, dtype=torch.long)
    position_ids = torch.zeros((len(rows), N), dtype=torch.long)
    given = rows[0][0].routes  # a MoE sampler's routes travel with their tokens (-1 at padding)
    routes = None if given is None else torch.full((len(rows), N, *given.shape[1:]), -1, dtype=given.dtype)
    order, score_at, targets = [], [], []
    for r, row in enumerate(rows):
        at = 0
        for s in row:
            input_ids[r, at : at + s.length] = s.ids
            position_ids[r, at : at + s.length] = torch.arange(s.length)
            if routes is not None:
                routes[r, at : at + s.length] = s.routes
            first = at + s.prompt_len  # the first completion token; the state before it predicts it
            score_at.append(r * N + torch.arange(first - 1, first - 1 + s.completion_len))
            targets.append(s.ids[s.prompt_len : s.prompt_len + s.completion_len])
            order.append(s)
            at += s.length
        if at < N:  # padding: a sequence of its own (positions restart), so no real token attends to it
            position_ids[r, at:] = torch.arange(N - at)
    return PackedStep(
        input_ids,
        position_ids,
        order,
        torch.cat(score_at),
        torch.cat(targets),
        [widths[s.micro] for s in order],
        routes,
    )


def packed_logprobs(
    forward: Callable[[PackedStep, Optional[int]], torch.Tensor], micro: List[dict], budget: TokenBudget, group=None
) -> List[torch.Tensor]:
    """Per-token values of every logical micro-batch ([B, T] each) computed by `forward(step, owner)` ([n] of one
    packed step) over the round's sequences packed under the budget (a no-grad pass: old-policy and reference
    log-probs). With sequence parallelism the group runs every member's steps; each rank keeps its own."""
    from .sequence_parallel import each_member

    widths = [mb["completion_mask"].shape[1] for mb in micro]
    (steps,) = plan_steps([sequences_of(micro)], budget.step_tokens, budget.hidden, budget.pad_id, widths, group=group)
    me = budget.sp.rank if budget.sp is not None else None
    values = [v for owner, step in each_member(steps, budget.sp) for v in [forward(step, owner)] if owner == me]
    return scatter(steps, values, [mb["completion_mask"].shape for mb in micro])
