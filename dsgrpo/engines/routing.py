"""Mixture-of-experts routing: record which experts each token is routed to, and replay given routes (issue 31).

Rollout routing replay (R3: verl's `router_replay.mode=R3`, slime's `--use-rollout-routing-replay`) makes the
training forward use the experts the sampler used, so small numeric differences between the two engines no
longer flip a token's top-k and, with it, the importance ratio. `RoutingTap` puts a forward hook on every
top-k router of a transformers MoE model (compat.moe_routers): the router still computes its logits from the
trainer's weights, and

    record   keeps each call's expert indices [N, k] per layer
    replay   replaces them with given ones [N, layers, k] (-1: keep the router's own choice, e.g. for prompt
             tokens the sampler did not report) and recomputes the gate weights as the router would for those
             experts: softmax over all experts, gathered at the replayed ones, renormalised when the model's
             norm_topk_prob says so. The logits keep their graph, so the router still learns; the load-balancing
             loss reads the logits (its own top-k), so it keeps its meaning.

Either way it counts how often the router's own top-k set equals the given one (`agreement`: the fraction of
(token, layer) routes that agree, the R3 study's measure). Pure torch and module hooks: the hooks see one
router call at a time, so the given routes must be laid out as the forward flattens its tokens ([batch, seq]
row-major, as the MoE block's `view(-1, hidden)`)."""

from __future__ import annotations

import contextlib
from typing import List, Optional

import torch

from .. import compat


class RoutingTap:
    def __init__(self, model):
        self.routers = compat.moe_routers(model)
        self.recorded: Optional[List[List[torch.Tensor]]] = None  # per layer, each call's [N, k]
        self._replay: Optional[torch.Tensor] = None               # [N, layers, k]
        self.agreed = 0
        self.compared = 0
        self._handles = [r.register_forward_hook(self._hook(layer)) for layer, r in enumerate(self.routers)]

    @property
    def is_moe(self) -> bool:
        return bool(self.routers)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # ---- what a forward does with the routes
    @contextlib.contextmanager
    def record(self):
        """Inside: every router call's own indices are kept; yields the per-layer lists."""
        self.recorded = [[] for _ in self.routers]
        try:
            yield self.recorded
        finally:
            self.recorded = None

    @contextlib.contextmanager
    def replay(self, experts: torch.Tensor):
        """Inside: the forward routes its N flattened tokens to `experts` [N, layers, k] (int; -1 = own choice)."""
        if experts.dim() != 3 or experts.shape[1] != len(self.routers):
            raise ValueError(f"replayed routes have shape {tuple(experts.shape)}; this model needs [tokens, "
                             f"{len(self.routers)} layers, top_k]")
        self._replay = experts.long()
        try:
            yield
        finally:
            self._replay = None

    @property
    def agreement(self) -> float:
        """The fraction of compared (token, layer) routes whose own top-k set equals the given one (nan: none)."""
        return self.agreed / self.compared if self.compared else float("nan")

    def reset_agreement(self) -> None:
        self.agreed = self.compared = 0

    # ---- the hook
    def _hook(self, layer: int):
        def hook(module, inputs, output):
            logits, weights, own = output
            if self.recorded is not None:
                self.recorded[layer].append(own.detach().clone())
            if self._replay is None:
                return None
            given = self._replay[:, layer, :].to(own.device)
            if given.shape != own.shape:
                raise ValueError(f"layer {layer}: {tuple(own.shape)} routes computed, {tuple(given.shape)} given: "
                                 "the replayed routes are not laid out as this forward's tokens")
            known = (given >= 0).all(dim=-1)                                     # [N]: tokens with a given route
            same = (own.sort(dim=-1).values == given.sort(dim=-1).values).all(dim=-1)
            self.agreed += int((same & known).sum())
            self.compared += int(known.sum())
            chosen = torch.where(known[:, None], given, own)
            probs = torch.softmax(logits, dim=-1, dtype=torch.float)
            gate = probs.gather(-1, chosen)
            if getattr(module, "norm_topk_prob", False):
                gate = gate / gate.sum(dim=-1, keepdim=True)
            return logits, gate.to(weights.dtype), chosen
        return hook


def routes_of(recorded: List[List[torch.Tensor]]) -> torch.Tensor:
    """[N, layers, k] from a `record()` of one forward (one call per layer)."""
    if any(len(calls) != 1 for calls in recorded):
        raise ValueError("routes_of takes the record of exactly one forward")
    return torch.stack([calls[0] for calls in recorded], dim=1)
