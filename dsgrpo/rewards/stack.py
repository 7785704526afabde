"""The reward stack: K reward sources → an [N, K] matrix (NaN where a source abstained with None), kept before
weighting so each source is logged on its own.

A source is, as in TRL: a callable `f(prompts, completions, completion_ids=..., **columns)` (plain or
`async def`; async ones run concurrently) returning one float or None per completion; a built-in name
(`accuracy_reward`, ...); a hub id / local path of a sequence-classification reward model; a
`PreTrainedModel`; or a `RemoteReward`. Construction checks every source cheaply; `load_models` then builds
the reward-model engines (a collective step under ZeRO-3: every rank calls it)."""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
from numbers import Real
from typing import Any, Callable, Dict, List, Sequence

import torch

from .. import compat
from .builtins import BUILTIN_REWARDS
from .remote import RemoteReward
from .sandbox import CodeReward

logger = logging.getLogger(__name__)


def reward_name(fn: Any) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


class RewardError(ValueError):
    """A reward source failed or returned something that is not a reward."""


class RewardStack:
    def __init__(
        self,
        reward_funcs: Any,
        reward_weights=None,
        reward_processing_classes=None,
        errors_as_none: bool = False,
        trust_remote_code: bool = False,
        code_sandbox: str = "isolated",
        extra_sources: Sequence[Callable] = (),
    ):
        """`extra_sources`: reward sources the run adds after the user's (environments that own a reward), each of
        weight 1 and without a processing class."""
        self.trust_remote_code = trust_remote_code
        self.code_sandbox = code_sandbox
        sources = (
            []
            if reward_funcs is None
            else list(reward_funcs)
            if isinstance(reward_funcs, (list, tuple))
            else [reward_funcs]
        )
        if not sources and not extra_sources:
            raise ValueError(
                "No reward source provided: pass reward_funcs (functions, built-in names or reward "
                "models), or an environment_factory whose environment defines get_reward()."
            )
        # TRL's rule: None applies to every source; one processing class is a list of one
        tokenizers = (
            [None] * len(sources)
            if reward_processing_classes is None
            else list(reward_processing_classes)
            if isinstance(reward_processing_classes, (list, tuple))
            else [reward_processing_classes]
        )
        if len(tokenizers) != len(sources):
            raise ValueError(
                f"The number of reward processing classes ({len(tokenizers)}) must match the number of "
                f"reward functions ({len(sources)}): give one per source (None where it does not apply)."
            )
        self.funcs: List[Any] = []
        self.given_tokenizers = tokenizers
        self.pending_models: Dict[int, tuple] = {}  # index → (spec, tokenizer), built by load_models
        self._model_configs: Dict[int, Any] = {}  # index → the reward model's transformers config
        for i, (src, tok) in enumerate(zip(sources, tokenizers)):
            self.funcs.append(self._resolve(src, tok, i))
        self.funcs += list(extra_sources)
        self.given_tokenizers = tokenizers + [None] * len(extra_sources)
        self.names = [self._name(i, f) for i, f in enumerate(self.funcs)]
        for f in self.funcs:  # before any compute: a remote scorer that is down or refuses the token, a code
            if isinstance(f, (RemoteReward, CodeReward)):  # sandbox that cannot be built on this machine
                f.check()
        self.model_indices = sorted(self.pending_models)
        self.errors_as_none = errors_as_none
        if reward_weights is not None and len(reward_weights) != len(sources):
            raise ValueError(
                f"reward_weights has {len(reward_weights)} entries but there are {len(sources)} "
                "reward functions; give one weight per function."
            )
        # the weight of each source, as advantages apply them: the user's (None: 1.0), then 1.0 per extra source
        self.weights = [float(w) for w in (reward_weights if reward_weights is not None else [1.0] * len(sources))]
        self.weights += [1.0] * len(extra_sources)

    @property
    def remote_names(self) -> List[str]:
        return [self.names[i] for i, f in enumerate(self.funcs) if isinstance(f, RemoteReward)]

    def pop_retries(self) -> List[float]:
        """Retried requests of each remote scorer since the last call (in remote_names' order)."""
        return [float(f.pop_retries()) for f in self.funcs if isinstance(f, RemoteReward)]

    @property
    def counted_names(self) -> List[str]:
        """The functions that count rows they could not judge (code_reward's sandbox): `rewards/<name>/errors`."""
        return [self.names[i] for i, f in enumerate(self.funcs) if _counts_errors(f)]

    def pop_errors(self) -> List[float]:
        """Rows each counting function could not judge since the last call (in counted_names' order)."""
        return [float(sum(f.pop_errors().values())) for f in self.funcs if _counts_errors(f)]

    def model_configs(self) -> list:
        """The transformers configs of the reward models, in reward order (for the memory planner)."""
        return [self._model_configs[i] for i in sorted(self._model_configs)]

    def _resolve(self, src: Any, tokenizer: Any, index: int):
        from transformers import PreTrainedModel

        if isinstance(src, str):
            if src in BUILTIN_REWARDS:
                return self._resolve(BUILTIN_REWARDS.get(src), tokenizer, index)
            from transformers import AutoConfig

            from .models import check_reward_model_config

            try:
                config = AutoConfig.from_pretrained(src, trust_remote_code=self.trust_remote_code)
            except (OSError, ValueError) as exc:
                raise ValueError(
                    f"reward_funcs[{index}] = {src!r} is neither a built-in reward "
                    f"({BUILTIN_REWARDS.names()}) nor a loadable reward model ({exc})."
                ) from None
            check_reward_model_config(config, src)
            self.pending_models[index] = (src, tokenizer)
            self._model_configs[index] = config
            return src
        if isinstance(src, PreTrainedModel):
            from .models import check_reward_model_config

            check_reward_model_config(src.config, reward_name(src))
            self.pending_models[index] = (src, tokenizer)
            self._model_configs[index] = src.config
            return src
        if isinstance(src, CodeReward):  # the built-in, by name or by object: with the run's code_sandbox
            return src.with_isolation(self.code_sandbox)
        if callable(src):
            return src
        raise TypeError(
            f"reward_funcs[{index}] = {src!r} is not a reward source: pass a callable, a built-in name "
            f"({BUILTIN_REWARDS.names()}), a reward model path / hub id / PreTrainedModel, or a RemoteReward."
        )

    def _name(self, index: int, f: Any) -> str:
        if index in self.pending_models:
            spec = self.pending_models[index][0]
            return (
                str(spec).rstrip("/").split("/")[-1]
                if isinstance(spec, str)
                else str(compat.name_or_path(spec.config) or type(spec).__name__).rstrip("/").split("/")[-1]
            )
        return reward_name(f)

    @property
    def processing_classes(self) -> list:
        """TRL's trainer.reward_processing_classes: each reward model's tokenizer (None for functions)."""
        return [
            getattr(f, "tokenizer", None) if i in self.model_indices else self.given_tokenizers[i]
            for i, f in enumerate(self.funcs)
        ]

    @property
    def has_models(self) -> bool:
        """Reward models are sharded engines: scoring them is collective, so every rank must score in step."""
        return bool(self.model_indices)

    def load_models(self, *, args, ds_spec, dtype: torch.dtype, world_size: int) -> None:
        """Build the reward-model engines (every rank, same order) for `world_size` training ranks."""
        from .models import RewardModel

        for index, (spec, tok) in sorted(self.pending_models.items()):
            model = RewardModel.sharded(spec, tok, args=args, ds_spec=ds_spec, dtype=dtype, world_size=world_size)
            model.__name__ = self.names[index]
            self.funcs[index] = model
        self.pending_models = {}

    # ------------------------------------------------------------------------------------------------ scoring
    def __call__(
        self,
        prompts: Sequence,
        completions: Sequence,
        completion_ids: Sequence,
        columns: Dict[str, Sequence],
        trainer_state: Any = None,
    ) -> torch.Tensor:
        """[N, K] float32, NaN for None. `trainer_state` (TRL's): the trainer's TrainerState, passed to the
        functions whose signature names it (or takes **kwargs) — curriculum rewards read global_step from it."""
        if self.pending_models:
            raise RuntimeError("RewardStack.load_models() must run before scoring with reward models.")
        kwargs = dict(
            prompts=list(prompts), completions=list(completions), completion_ids=list(completion_ids), **columns
        )
        results: List[Any] = [None] * len(self.funcs)
        pending = {}
        for k, f in enumerate(self.funcs):
            call_kwargs = dict(kwargs, trainer_state=trainer_state) if takes_trainer_state(f) else kwargs
            out = self._call(k, f, call_kwargs)
            if inspect.isawaitable(out):
                pending[k] = out
            else:
                results[k] = out
        if pending:  # async reward functions run concurrently
            for k, out in zip(pending, asyncio.run(self._gather(pending))):
                results[k] = out
        matrix = torch.full((len(completions), len(self.funcs)), math.nan)
        for k, values in enumerate(results):
            matrix[:, k] = self._check(k, values, len(completions))
        unscored = torch.isnan(matrix).all(dim=1).nonzero().flatten().tolist()
        if unscored:  # TRL warns too, through its logger and in its words: such a completion gets no advantage
            i = unscored[0]
            row = {"prompt": prompts[i], "completion": completions[i], **{k: v[i] for k, v in columns.items()}}
            logger.warning(
                f"All reward functions returned None for the following kwargs: {row} ({len(unscored)} of "
                f"{len(completions)} completions get no reward). Please ensure that at least one reward "
                "function returns a valid reward."
            )
        return matrix

    def _call(self, k: int, f: Callable, kwargs: dict) -> Any:
        try:
            return f(**kwargs)
        except Exception as exc:
            return self._failed(k, exc)

    async def _gather(self, pending: dict):
        async def guard(k, awaitable):
            try:
                return await awaitable
            except Exception as exc:
                return self._failed(k, exc)

        return await asyncio.gather(*(guard(k, a) for k, a in pending.items()))

    def _failed(self, k: int, exc: Exception):
        if self.errors_as_none:
            return None  # expanded to all-None by _check
        raise RewardError(
            f"Reward function {self.names[k]!r} raised {type(exc).__name__}: {exc}. Fix it, or set "
            "reward_errors_as_none=True to score such batches as None."
        ) from exc

    def _check(self, k: int, values: Any, n: int) -> torch.Tensor:
        if values is None and self.errors_as_none:
            return torch.full((n,), math.nan)
        try:
            values = list(values)
        except TypeError:
            raise RewardError(
                f"Reward function {self.names[k]!r} returned {type(values).__name__}; return a list "
                "with one float (or None) per completion."
            ) from None
        if len(values) != n:
            raise RewardError(
                f"Reward function {self.names[k]!r} returned {len(values)} values for {n} "
                "completions; return one float (or None) per completion."
            )
        column = torch.full((n,), math.nan)
        for i, v in enumerate(values):
            if v is None:
                continue  # no opinion: NaN, excluded from this function's statistics
            if isinstance(v, torch.Tensor) and v.numel() == 1:
                v = v.item()
            if not isinstance(v, Real) or not math.isfinite(float(v)):
                raise RewardError(
                    f"Reward function {self.names[k]!r} returned {v!r} for completion {i}; return a "
                    "finite float, or None to abstain."
                )
            column[i] = float(v)
        return column


def _counts_errors(f: Callable) -> bool:
    """A reward source that counts the rows it could not judge: a `pop_errors() -> {reason: rows}` method."""
    return callable(getattr(f, "pop_errors", None))


def takes_trainer_state(f: Callable) -> bool:
    """A Python reward function that names `trainer_state` or takes **kwargs (reward models and remote scorers,
    which take columns over JSON, never get it)."""
    from .models import RewardModel
    from .remote import RemoteReward

    if isinstance(f, (RewardModel, RemoteReward)):
        return False
    try:
        params = inspect.signature(f).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "trainer_state" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
