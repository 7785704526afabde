"""The `Generator` protocol and the `Rollout` batch it returns.

A generator turns prompt token ids into completions, each with the sampler's own log-probability of every
sampled token (for the importance-sampling correction). Backends: `vllm` (colocated, in-process) and `hf`
(DeepSpeed engine's `generate`)."""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np
import torch


SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# generation_kwargs spell some sampling fields the way transformers' generate() does
HF_NAMES = {"max_new_tokens": "max_tokens"}


@dataclass
class SamplingConfig:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: float = 1.0
    extra: dict = field(default_factory=dict)  # generation_kwargs that are not one of the fields above
    regex: Optional[str] = None  # vllm_structured_outputs_regex

    @classmethod
    def from_args(cls, args) -> "SamplingConfig":
        """The config's sampling fields, overridden by generation_kwargs where it names one (TRL lets
        generation_kwargs win: `{"top_k": 10}` is top_k=10, not a duplicate argument)."""
        named = dict(
            max_tokens=args.max_completion_length,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            min_p=args.min_p,
            repetition_penalty=args.repetition_penalty,
        )
        extra = {}
        for key, value in (args.generation_kwargs or {}).items():
            key = HF_NAMES.get(key, key)
            if key in SAMPLING_FIELDS:
                named[key] = value
            else:
                extra[key] = value
        return cls(**named, extra=extra, regex=getattr(args, "vllm_structured_outputs_regex", None))

    def to_json(self) -> dict:
        """The fields as plain values (a server request); SamplingConfig(**d) reads them back."""
        return {f: getattr(self, f) for f in self.__dataclass_fields__}


ROUTE_DTYPE = torch.int16  # expert indices (-1: not reported); models have at most a few hundred experts
ROUTES_FORMAT = "int16le-base64"


def encode_routes(routes: List[torch.Tensor]) -> dict:
    """Rows of routes ([tokens, layers, k] each) as one JSON value: their int16 little-endian bytes end to end in
    base64, each row's token count and the common [layers, k]. A 2,000-token row of a 48-layer top-8 model of 128
    experts is 2.0 MB of JSON this way, 3.4 MB as lists of numbers (and far quicker to parse)."""
    shape = list(routes[0].shape[1:]) if routes else []
    if any(list(r.shape[1:]) != shape for r in routes):
        raise ValueError(f"routes of different [layers, top_k]: {sorted({tuple(r.shape[1:]) for r in routes})}")
    data = b"".join(r.to("cpu", ROUTE_DTYPE).contiguous().numpy().astype("<i2").tobytes() for r in routes)
    return {
        "format": ROUTES_FORMAT,
        "tokens": [int(r.shape[0]) for r in routes],
        "shape": shape,
        "data": base64.b64encode(data).decode("ascii"),
    }


def decode_routes(value, tokens: Optional[List[int]] = None, source: str = "routes") -> List[torch.Tensor]:
    """encode_routes' rows back (or a pool checkpointed before it: nested lists). `tokens`: each row's expected
    token count (prompt + completion). What does not fit is refused naming `source`, so a server that sends
    something else fails here, not inside a forward."""

    def bad(why: str) -> ValueError:
        return ValueError(
            f"{source}: {why}; expected encode_routes' {{format: {ROUTES_FORMAT!r}, tokens, shape, data}}"
        )

    def check_counts(counts: List[int]) -> None:
        if tokens is not None and counts != list(tokens):
            raise bad(
                f"{len(counts)} rows of {counts[:8]} tokens for {len(tokens)} rows of {list(tokens)[:8]} "
                "tokens (prompt + completion)"
            )

    if isinstance(value, list):
        rows = [torch.tensor(r, dtype=ROUTE_DTYPE) for r in value]
        check_counts([len(r) for r in rows])
        return rows

    if not isinstance(value, dict) or value.get("format") != ROUTES_FORMAT:
        raise bad(f"got {type(value).__name__} of format {value.get('format') if isinstance(value, dict) else None!r}")
    counts, shape, data = value.get("tokens"), value.get("shape"), value.get("data")
    if not (isinstance(counts, list) and all(type(n) is int and n >= 0 for n in counts)):
        raise bad("'tokens' is not a list of token counts")
    if counts and not (isinstance(shape, list) and len(shape) == 2 and all(type(n) is int and n > 0 for n in shape)):
        raise bad(f"'shape' {shape!r} is not [layers, top_k]")
    check_counts(counts)
    if not isinstance(data, str):
        raise bad("'data' is not a base64 string")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise bad("'data' is not valid base64") from None
    per_token = shape[0] * shape[1] if counts else 0
    if len(raw) != 2 * per_token * sum(counts):
        raise bad(f"{len(raw)} bytes of data for {sum(counts)} tokens x {shape} int16 routes")
    if not counts:
        return []
    flat = torch.from_numpy(np.frombuffer(raw, dtype="<i2").astype(np.int16))
    if len(flat) and int(flat.min()) < -1:
        raise bad(f"an expert index of {int(flat.min())} (-1 is the least: not reported)")
    return [row.reshape(n, *shape).clone() for row, n in zip(flat.split([n * per_token for n in counts]), counts)]


ROLLOUT_LISTS = ("prompt_ids", "completion_ids", "sampler_logprobs", "truncated")
# columns of live objects (each rollout's environment instance): scored where they were made, never serialised
LOCAL_COLUMNS = ("environments",)
ROLLOUT_OPTIONAL = ("tool_mask", "messages", "tool_counts", "weight_versions", "restarts")


@dataclass
class Rollout:
    """Completions of one rank, in slot order. Row i answers `prompt_ids[i]` (prompts repeat within a group)."""

    prompt_ids: List[List[int]]
    completion_ids: List[List[int]]  # sampled tokens (and inserted ones: tool_mask), eos included if it stopped
    sampler_logprobs: List[List[float]]  # the sampler's log-prob of each sampled token
    truncated: List[bool]  # True when max_tokens cut the completion
    # 1 = sampled token, 0 = token the trainer inserted (a tool result, see rollout/tools.py): inserted tokens stay
    # in input_ids as context but leave the loss; their sampler_logprobs are 0.0. None: every token was sampled.
    tool_mask: Optional[List[List[int]]] = None
    # with tools: each completion as TRL's reward functions see it, the turns as messages (assistant turns with
    # their "tool_calls", then the tool results); None: the decoded text is the one assistant message
    messages: Optional[List[List[dict]]] = None
    # with tools: the counts of each completion (rollout/tools.py COUNTS: calls, failed calls, ...; the tools/* metrics)
    tool_counts: Optional[List[List[int]]] = None
    # extra per-row columns for the reward functions (what a rollout_func returns beside the tokens)
    columns: Optional[Dict[str, list]] = None
    # MoE policies: the experts the sampler routed each token to, per row an int tensor [prompt + completion tokens,
    # layers, top_k] (-1: not reported, the trainer's router chooses). engines/routing.py replays or compares them.
    routes: Optional[List[torch.Tensor]] = None
    # the policy version (weight syncs seen: 0 = the initial weights) each completion token was sampled with, as the
    # engine labelled it; None where no one said (rollout sources fill it from the generator's version)
    weight_versions: Optional[List[List[int]]] = None
    # per row, [[at, prompt_ids], ...]: the completion from token `at` on was sampled after `prompt_ids` (an agent that
    # rewrote its history, rollout/agents.py), not after the row's prompt and completion so far. Such a row trains as
    # one sequence per piece, each with its own prompt (layout.sequences_of: packed steps only); [] or None: one
    restarts: Optional[List[List[list]]] = None

    def rows(self, rows: slice) -> "Rollout":
        """The rows `rows` as a Rollout of their own (optional fields kept)."""
        out = Rollout(*(getattr(self, k)[rows] for k in ROLLOUT_LISTS))
        for k in ROLLOUT_OPTIONAL:
            if getattr(self, k) is not None:
                setattr(out, k, getattr(self, k)[rows])
        if self.columns is not None:
            out.columns = {c: v[rows] for c, v in self.columns.items()}
        if self.routes is not None:
            out.routes = self.routes[rows]
        return out

    @staticmethod
    def concat(parts: Sequence["Rollout"]) -> "Rollout":
        """The rows of `parts`, in order. A tool_mask is kept when any part has one (rows of parts without one get
        all ones: every token sampled); messages, tool counts and columns only when every part has them."""
        out = Rollout([], [], [], [])
        for part in parts:
            for k in ROLLOUT_LISTS:
                getattr(out, k).extend(getattr(part, k))
        if any(p.tool_mask is not None for p in parts):
            out.tool_mask = [
                m
                for p in parts
                for m in (p.tool_mask if p.tool_mask is not None else [[1] * len(c) for c in p.completion_ids])
            ]
        if any(p.restarts is not None for p in parts):
            out.restarts = [
                r for p in parts for r in (p.restarts if p.restarts is not None else [[] for _ in p.completion_ids])
            ]
        for k in ("messages", "tool_counts", "weight_versions"):
            if parts and all(getattr(p, k) is not None for p in parts):
                setattr(out, k, [x for p in parts for x in getattr(p, k)])
        if parts and all(p.columns is not None for p in parts):  # a column some parts lack (LOCAL_COLUMNS, not
            out.columns = {
                c: [v for p in parts for v in p.columns[c]]  # sent with a group another rank made) is left
                for c in parts[0].columns
                if all(c in p.columns for p in parts)
            }
        if parts and all(p.routes is not None for p in parts):
            out.routes = [r for p in parts for r in p.routes]
        return out

    def to_json(self) -> dict:
        """Plain lists and dicts (a checkpoint's pool, a split-placement exchange). `columns` must be JSON-able, but
        for live objects that stay on the rank that made them (LOCAL_COLUMNS: environments, already scored)."""
        out = {k: getattr(self, k) for k in ROLLOUT_LISTS + ROLLOUT_OPTIONAL + ("columns",)}
        if self.columns is not None:
            out["columns"] = {c: v for c, v in self.columns.items() if c not in LOCAL_COLUMNS}
        out["routes"] = None if self.routes is None else encode_routes(self.routes)
        return out

    @classmethod
    def from_json(cls, d: dict) -> "Rollout":
        # .get: pools checkpointed before a field existed lack its key (None: the field's default)
        out = cls(*(d[k] for k in ROLLOUT_LISTS), **{k: d.get(k) for k in ROLLOUT_OPTIONAL + ("columns",)})
        if d.get("routes") is not None:
            out.routes = decode_routes(d["routes"])
        return out

    def __len__(self) -> int:
        return len(self.completion_ids)

    def tensors(self, pad_id: int, rows: Optional[slice] = None, pad_to_multiple_of: Optional[int] = None) -> dict:
        """Padded tensors for rows: input_ids [B, P+T] (prompts left-padded, completions right-padded),
        attention_mask [B, P+T], completion_mask [B, T] (0 at padding and tool-result tokens), sampler_logps [B, T],
        and with routes, routes [B, P+T, layers, top_k] laid out as input_ids (-1 at padding).
        With `pad_to_multiple_of`, P and T are rounded up to a multiple of it (fewer distinct shapes)."""
        idx = range(len(self))[rows or slice(None)]
        P = max(len(self.prompt_ids[i]) for i in idx)
        T = max(1, max(len(self.completion_ids[i]) for i in idx))
        if pad_to_multiple_of:
            P, T = (-(-n // pad_to_multiple_of) * pad_to_multiple_of for n in (P, T))
        B = len(idx)
        input_ids = torch.full((B, P + T), pad_id, dtype=torch.long)
        attention = torch.zeros((B, P + T), dtype=torch.long)
        sampler = torch.zeros((B, T), dtype=torch.float32)
        sampled = torch.ones((B, T), dtype=torch.float32)
        routes = (
            None
            if self.routes is None
            else torch.full((B, P + T, *self.routes[idx[0]].shape[1:]), -1, dtype=ROUTE_DTYPE)
        )  # laid out as input_ids
        for row, i in enumerate(idx):
            p, c = self.prompt_ids[i], self.completion_ids[i]
            input_ids[row, P - len(p) : P] = torch.tensor(p)
            attention[row, P - len(p) : P + len(c)] = 1
            if routes is not None:
                routes[row, P - len(p) : P + len(c)] = self.routes[i]
            if c:
                input_ids[row, P : P + len(c)] = torch.tensor(c)
                sampler[row, : len(c)] = torch.tensor(self.sampler_logprobs[i], dtype=torch.float32)
                if self.tool_mask is not None:
                    sampled[row, : len(c)] = torch.tensor(self.tool_mask[i], dtype=torch.float32)
        completion_mask = attention[:, P:].float() * sampled
        out = {
            "input_ids": input_ids,
            "attention_mask": attention,
            "completion_mask": completion_mask,
            "sampler_logps": sampler,
        }
        if self.weight_versions is not None:  # the policy version of each token (-1 at padding)
            versions = torch.full((B, T), -1, dtype=torch.long)
            for row, i in enumerate(idx):
                if self.weight_versions[i]:
                    versions[row, : len(self.weight_versions[i])] = torch.tensor(self.weight_versions[i])
            out["token_versions"] = versions
        if routes is not None:
            out["routes"] = routes
        if self.restarts is not None and any(self.restarts[i] for i in idx):
            out["restarts"] = [self.restarts[i] for i in idx]
        return out

    def lengths(self) -> torch.Tensor:
        return torch.tensor([len(c) for c in self.completion_ids], dtype=torch.float32)


def round_seed(seed: int, round_index: int, slot: int) -> int:
    """A sampling seed for the prompt run starting at `slot` of generation round `round_index`."""
    return (seed * 1_000_003 + round_index * 100_003 + slot) % (2**31 - 1)


class Generator:
    """What rollout sources, the weight sync and the agent endpoint ask of an engine. A generator implements
    `generate` and `load_weights`; everything else below is a documented default it overrides where it differs
    (nothing probes for a method with hasattr). `rollout/hf_generate.FollowsReplacedGenerate` is the one exception:
    it forwards every attribute to the engine it wraps, so it is not a subclass (a default here would hide the
    engine's)."""

    weight_version: int = 0  # weight loads taken (0: the initial weights); every sampled token is labelled
    max_model_len: Optional[int] = None  # the longest prompt + completion the engine serves (None: not known)
    loads_weight_groups = False  # takes a sync's groups as they come (load_weight_groups), not one stream
    sends_weights = False  # load_weights sends the bytes to another process: a sync times it as wire time

    def generate(
        self,
        prompt_ids: List[List[int]],
        counts: List[int],
        sampling: SamplingConfig,
        seeds: Optional[List[int]] = None,
    ) -> Rollout:
        """Generate counts[j] completions for prompt j (sampled from seeds[j] when given); rows come out prompt
        by prompt, in order."""
        raise NotImplementedError

    def load_weights(self, named_tensors: Iterable[Tuple[str, torch.Tensor]]) -> None:
        """Replace the engine's weights with these HF-named full tensors (a no-op for backends that share the
        policy's parameters)."""
        raise NotImplementedError

    def load_weight_groups(self, groups, stats) -> Optional[list]:
        """With `loads_weight_groups`: take a sync's groups (rollout/weight_source.py) one at a time, timing into
        `stats`; returns the checksums of what it received (None: not checked)."""
        raise NotImplementedError

    def needs_weight_sync(self) -> bool:
        """Whether the policy's weights must be copied in after each update (False: it samples from them directly)."""
        return True

    def end_generation(self) -> None:
        """A round's completions are all made (the engine may release memory until its next weight load)."""

    def needs_weights(self) -> bool:
        """True when the engine cannot generate before a weight load (asleep at level 2)."""
        return False

    def weights_not_held(self) -> set:
        """Names a sync sends that the engine does not keep (not compared when checksums are checked)."""
        return set()

    def received_checksums(self) -> Optional[list]:
        """After a streamed load: the checksums of what the engine received (None: not checked)."""
        return None
