"""Generation with the policy engine's own Hugging Face `generate` (use_vllm=False).

Under ZeRO-3 every forward gathers parameters collectively, so all ranks must run the same number of decoding
steps: `synced_gpus=True` keeps finished ranks stepping until every rank is done. With ds3_gather_for_generation
(TRL's default) the whole policy is gathered once for the call, so decoding reads full weights instead of gathering
every layer at every token (the memory of one full copy for the call's duration)."""

from __future__ import annotations

import contextlib
from typing import Iterable, List, Optional, Tuple

import torch

from .. import compat, dist
from ..engines import routing
from .base import ROUTE_DTYPE, Generator, Rollout, SamplingConfig


class HFGenerator(Generator):
    def __init__(
        self,
        engine,
        tokenizer,
        *,
        zero3: bool,
        gather_for_generation: bool = True,
        cache_implementation: Optional[str] = None,
    ):
        self.engine = engine
        self.tokenizer = tokenizer
        self.zero3, self.gather = zero3, gather_for_generation and zero3
        # ranks still step together while gathered: ZeRO-3's module hooks run on every forward and must match
        self.synced = zero3 and dist.world_size() > 1
        self.cache_implementation = cache_implementation

    def needs_weight_sync(self) -> bool:
        return False  # generation reads the policy's own parameters

    def end_generation(self) -> None:
        pass

    def needs_weights(self) -> bool:
        return False

    def load_weights(self, named_tensors: Iterable[Tuple[str, torch.Tensor]]) -> None:
        for _ in named_tensors:
            pass

    def _gathered(self):
        """The whole policy gathered for one generate call (ds3_gather_for_generation), or nothing to do."""
        if not self.gather:
            return contextlib.nullcontext()
        return compat.gathered_without_hooks(self.engine)

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: List[List[int]],
        counts: List[int],
        sampling: SamplingConfig,
        seeds: Optional[List[int]] = None,
    ) -> Rollout:
        rows = [ids for ids, n in zip(prompt_ids, counts) for _ in range(n)]
        if seeds:  # one batch, one generator: seeded by the round's first seed
            torch.manual_seed(seeds[0])
        model = self.engine.module
        was_training = model.training
        model.eval()
        pad = self.tokenizer.pad_token_id
        eos = self.tokenizer.eos_token_id
        P = max(len(r) for r in rows)
        input_ids = torch.full((len(rows), P), pad, dtype=torch.long)
        attention = torch.zeros((len(rows), P), dtype=torch.long)
        for i, r in enumerate(rows):
            input_ids[i, P - len(r) :] = torch.tensor(r)
            attention[i, P - len(r) :] = 1
        device = next(model.parameters()).device
        tap = routing.tap_of(self.engine)  # a MoE policy: the experts of every token are kept (routing replay)
        if tap is not None:
            tap.use(None)
        with self._gathered(), tap.record() if tap is not None else contextlib.nullcontext() as recorded:
            out = model.generate(
                input_ids=input_ids.to(device),
                attention_mask=attention.to(device),
                do_sample=sampling.temperature > 0,  # temperature 0: greedy, as vLLM reads it
                max_new_tokens=sampling.max_tokens,
                temperature=sampling.temperature or None,
                top_p=sampling.top_p,
                top_k=sampling.top_k or 0,
                min_p=sampling.min_p,
                repetition_penalty=sampling.repetition_penalty,
                pad_token_id=pad,
                eos_token_id=eos,
                use_cache=True,
                synced_gpus=self.synced,
                output_scores=True,
                return_dict_in_generate=True,
                cache_implementation=self.cache_implementation,
                **hf_generate_kwargs(sampling),
            )
        if was_training:
            model.train()
        if isinstance(out, torch.Tensor):  # a generate that returns the sequences alone (a user's, a test's mock)
            new = out[:, P:].cpu()
            logps = torch.full(new.shape, float("nan"))  # unknown: NaN (off_policy_mask and the gap metric skip it)
        else:
            new = out.sequences[:, P:].cpu()  # [B, T']
            scores = torch.stack(out.scores, dim=1).float().cpu()  # [B, T', V] processed
            logps = torch.log_softmax(scores, dim=-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)
        routes = None
        if recorded is not None and all(recorded):
            routes = routing.routes_of_generation(recorded, len(rows), P, new.shape[1]).to(ROUTE_DTYPE)
        rollout = Rollout([], [], [], [], routes=[] if routes is not None else None)
        for i, r in enumerate(rows):
            tokens = new[i].tolist()
            stop = tokens.index(eos) + 1 if eos in tokens else len(tokens)
            rollout.prompt_ids.append(list(r))
            rollout.completion_ids.append(tokens[:stop])
            rollout.sampler_logprobs.append(logps[i, :stop].tolist())
            rollout.truncated.append(eos not in tokens[:stop])
            if routes is not None:
                rollout.routes.append(routes[i, P - len(r) : P + stop].clone())
        return rollout


def hf_generate_kwargs(sampling: SamplingConfig) -> dict:
    """generation_kwargs that transformers' GenerationConfig knows (vLLM-only keys stay out)."""
    from transformers import GenerationConfig

    known = set(GenerationConfig().to_dict())
    return {k: v for k, v in sampling.extra.items() if k in known}


class FollowsReplacedGenerate:
    """use_vllm left to choose (None): vLLM generates, unless the code replaces the policy module's own `generate`
    after the trainer is built (TRL's scripted-model tests patch `trainer.model.generate`, meaning generation with
    transformers, TRL's default): from then on that method generates. Everything else is the vLLM generator's."""

    def __init__(self, engine_generator, make_hf, module):
        self.engine_generator, self.make_hf, self.module = engine_generator, make_hf, module
        self.hf = None

    def _replaced(self) -> bool:
        return "generate" in vars(self.module)  # an instance attribute shadows the class's method

    def generate(self, prompt_ids, counts, sampling, seeds=None) -> Rollout:
        if not self._replaced():
            return self.engine_generator.generate(prompt_ids, counts, sampling, seeds=seeds)
        if self.hf is None:
            self.hf = self.make_hf()
        return self.hf.generate(prompt_ids, counts, sampling, seeds=seeds)

    _OWN = ("engine_generator", "make_hf", "module", "hf")

    def __getattr__(self, name):
        return getattr(self.engine_generator, name)

    def __setattr__(self, name, value):  # a setting of the engine's (native_weights, ...) reaches the engine; a
        if name in self._OWN or hasattr(type(self), name):  # method of this class (a spy on generate) stays here
            object.__setattr__(self, name, value)
        else:
            setattr(self.engine_generator, name, value)
