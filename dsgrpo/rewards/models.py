"""Sequence-classification reward models (one scalar per text).

`RewardModel` scores prompt + completion re-tokenized with the reward model's own tokenizer (its chat
template when it has one). In training it is a frozen DeepSpeed ZeRO-3 engine sharded across the ranks like the
reference model; every rank scores its own completions in the same number of batches (the forward is
collective under ZeRO-3). `LocalRewardModel` is the same scorer on one process (for `serve-reward`)."""

from __future__ import annotations

import warnings
from typing import List, Sequence

import torch

from .. import compat
from .builtins import completion_text

GENERATIVE_SUFFIXES = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration", "ForMaskedLM")


def check_reward_model_config(config, name: str) -> None:
    """A reward model must be (or be loadable as) a sequence classifier; a generative checkpoint given here is
    almost always a mistake (it would get a random scoring head)."""
    archs = getattr(config, "architectures", None) or []
    if archs and all(a.endswith(GENERATIVE_SUFFIXES) for a in archs):
        raise ValueError(
            f"reward model {name!r} is a {archs[0]}, not a sequence-classification model. Pass a "
            "reward model (AutoModelForSequenceClassification, num_labels=1) or a reward function."
        )


def reward_tokenizer(tokenizer_or_path, name: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_or_path) if isinstance(tokenizer_or_path, str) else tokenizer_or_path
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise ValueError(f"reward model {name!r}: its tokenizer has neither a pad nor an eos token; set one.")
        warnings.warn(f"reward model {name!r}: tokenizer has no pad token; using eos ({tok.eos_token!r}).")
        tok.pad_token = tok.eos_token
    tok.padding_side = "right"
    return tok


def reward_texts(tokenizer, prompts: Sequence, completions: Sequence) -> List[str]:
    """What the reward model reads: the conversation through its chat template when the data is
    conversational and it has one, else prompt text followed by completion text."""
    texts = []
    for p, c in zip(prompts, completions):
        if isinstance(p, list) and getattr(tokenizer, "chat_template", None):
            messages = p + (c if isinstance(c, list) else [{"role": "assistant", "content": c}])
            texts.append(tokenizer.apply_chat_template(messages, tokenize=False))
        else:
            prompt = p if isinstance(p, str) else "".join(m["content"] for m in p)
            texts.append(prompt + completion_text(c))
    return texts


class RewardModel:
    """Scores texts with `forward` (a DeepSpeed engine or a plain module) in batches of `batch_size`."""

    def __init__(self, forward, tokenizer, config, batch_size: int, name: str, max_length: int = 2048):
        self.forward, self.tokenizer, self.batch_size = forward, tokenizer, batch_size
        self.max_length = min(max_length, getattr(config, "max_position_embeddings", max_length))
        self.__name__ = name
        config.pad_token_id = tokenizer.pad_token_id  # sequence classifiers find the last token through it

    @torch.no_grad()
    def __call__(self, prompts, completions, **kwargs) -> List[float]:
        texts = reward_texts(self.tokenizer, prompts, completions)
        scores: List[float] = []
        for start in range(0, len(texts), self.batch_size):
            enc = self.tokenizer(
                texts[start : start + self.batch_size],
                return_tensors="pt",
                padding=True,
                truncation=True,
                max_length=self.max_length,
            )
            logits = self.forward(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).logits
            scores.extend(logits[:, 0].float().tolist())
        return scores

    @classmethod
    def sharded(cls, spec, tokenizer, *, args, ds_spec, dtype: torch.dtype, world_size: int) -> "RewardModel":
        """A frozen engine over all ranks, ZeRO-3 unless one rank trains (collective: every rank builds it, in the
        same order)."""
        from transformers import AutoConfig, AutoModelForSequenceClassification, PreTrainedModel

        from ..engines import ModelLoader, build_inference_engine, resolve

        if isinstance(spec, PreTrainedModel):
            model, name = spec, _name(compat.name_or_path(spec.config) or type(spec).__name__)
            check_reward_model_config(model.config, name)
            hidden = getattr(model.config, "hidden_size", None)
        else:
            name = _name(spec)
            config = AutoConfig.from_pretrained(spec, trust_remote_code=args.trust_remote_code)
            check_reward_model_config(config, spec)
            hidden = getattr(config, "hidden_size", None)
        ds_config = resolve(ds_spec, args, hidden, "ref_deepspeed", train=False, world_size=world_size)
        if not isinstance(spec, PreTrainedModel):
            model = ModelLoader(ds_config, dtype).load(
                spec,
                cls=AutoModelForSequenceClassification,
                field="reward_funcs",
                num_labels=1,
                **args.model_load_kwargs,
            )
        tok = reward_tokenizer(tokenizer if tokenizer is not None else compat.name_or_path(model.config), name)
        engine = build_inference_engine(model, ds_config)
        return cls(engine, tok, model.config, args.per_device_train_batch_size, name)


class LocalRewardModel(RewardModel):
    """The same scorer in one process, without DeepSpeed (used by `dsgrpo serve-reward --model`)."""

    def __init__(self, path: str, tokenizer=None, batch_size: int = 16):
        from transformers import AutoConfig, AutoModelForSequenceClassification

        check_reward_model_config(AutoConfig.from_pretrained(path), path)
        model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1).eval()
        super().__init__(model, reward_tokenizer(tokenizer or path, path), model.config, batch_size, _name(path))


def _name(path: str) -> str:
    return str(path).rstrip("/").split("/")[-1]
