"""Prompt datasets: validation, chat templates, tokenisation, and the deterministic order in which prompts are
handed to ranks (the same on every rank, derived from the seed and the round number, so resuming needs only
the round number).

A generation round takes P = generation_batch / G prompts, repeats each G times into "slots", and gives rank r
the contiguous slots [r·L, (r+1)·L), L = generation_batch / world. A group may straddle two ranks; its
statistics are still exact because rewards are gathered before advantages are computed."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import torch


def load_dataset_spec(spec: Any, split: str = "train"):
    """A `datasets.Dataset` as is; a local .jsonl/.json/.parquet file; or a hub id (from the local cache)."""
    import datasets

    if spec is None or isinstance(spec, (datasets.Dataset, datasets.IterableDataset, list)):
        return datasets.Dataset.from_list(spec) if isinstance(spec, list) else spec
    if isinstance(spec, str):
        ext = os.path.splitext(spec)[1]
        if ext in (".jsonl", ".json", ".parquet"):
            if not os.path.exists(spec):
                raise FileNotFoundError(f"Dataset file {spec!r} does not exist.")
            return datasets.load_dataset("parquet" if ext == ".parquet" else "json", data_files=spec, split="train")
        return datasets.load_dataset(spec, split=split)
    raise TypeError(f"Unsupported dataset {type(spec).__name__}: pass a datasets.Dataset, a list of dicts, or a path.")


def is_conversational(prompt: Any) -> bool:
    return isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt)


@dataclass
class RoundSlice:
    """This rank's share of one generation round."""

    indices: List[int]  # dataset index of each distinct prompt, in slot order
    counts: List[int]  # how many of this rank's slots each one fills
    first_slot: int  # global position of this rank's first slot in the round


class PromptSource:
    # the generation round the prompt stream starts at (a resume with reset_data_position: the round it resumed at)
    round_offset = 0
    streaming = False

    def __init__(
        self,
        dataset,
        tokenizer,
        *,
        max_prompt_length: Optional[int],
        context_length: Optional[int],
        max_completion_length: int,
        chat_template_kwargs: Optional[dict] = None,
        field: str = "train_dataset",
        keep_columns: bool = True,
    ):
        if dataset is None:
            raise ValueError(f"{field} is None: pass a datasets.Dataset with a 'prompt' column.")
        if "prompt" not in dataset.column_names:
            raise ValueError(
                f"{field} has no 'prompt' column (columns: {dataset.column_names}). Rename the column "
                "that holds the prompts to 'prompt'."
            )
        if len(dataset) == 0:
            raise ValueError(f"{field} is empty: it needs at least one prompt.")
        self.dataset = dataset
        self.field = field
        # the columns reward functions get (remove_unused_columns=True: none but the prompt)
        self.columns = [c for c in dataset.column_names if c != "prompt"] if keep_columns else []
        self.conversational = is_conversational(dataset[0]["prompt"])
        if self.conversational and not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                f"{field} holds conversational prompts (lists of messages) but the tokenizer has no chat "
                "template. Pass a processing_class with a chat_template, or give plain-text prompts."
            )
        self.tokenizer = tokenizer
        self.chat_template_kwargs = chat_template_kwargs or {}
        self._orders: Dict[tuple, List[int]] = {}  # the permutation of the epoch in use
        self.prompt_ids = self._tokenize_all()
        self._check_lengths(max_prompt_length, context_length, max_completion_length)

    def __len__(self) -> int:
        return len(self.dataset)

    def identity(self) -> dict:
        """What tells this prompt set from another (recorded in checkpoints): its length and the datasets
        fingerprint of its rows, where the dataset has one."""
        return {"rows": len(self.dataset), "fingerprint": getattr(self.dataset, "_fingerprint", None)}

    def longest_prompt(self) -> Optional[int]:
        """Tokens of the longest prompt (None where the prompts are not all known before training: streaming)."""
        return None if self.streaming else max(len(ids) for ids in self.prompt_ids)

    def text(self, prompt: Any) -> str:
        if is_conversational(prompt):
            return self.tokenizer.apply_chat_template(
                prompt, tokenize=False, add_generation_prompt=True, **self.chat_template_kwargs
            )
        return prompt

    def _tokenize_all(self) -> List[List[int]]:
        return self.tokenize(self.dataset["prompt"])

    def tokenize(self, prompts: Sequence[Any]) -> List[List[int]]:
        texts = [self.text(p) for p in prompts]
        # chat templates already contain their special tokens; plain text gets the tokenizer's defaults
        return self.tokenizer(texts, add_special_tokens=not self.conversational)["input_ids"]

    def _check_lengths(self, max_prompt_length, context_length, max_completion_length) -> None:
        longest = max(range(len(self.prompt_ids)), key=lambda i: len(self.prompt_ids[i]))
        check_prompt_length(
            self.field, longest, len(self.prompt_ids[longest]), max_prompt_length, context_length, max_completion_length
        )

    # ------------------------------------------------------------------------------------ ordering
    def order(self, epoch: int, seed: int, shuffle: bool) -> List[int]:
        if not shuffle:
            return list(range(len(self)))
        key = (epoch, seed)
        if key not in self._orders:
            self._orders = {
                key: torch.randperm(len(self), generator=torch.Generator().manual_seed(seed + epoch)).tolist()
            }
        return self._orders[key]

    def rounds_per_epoch(self, prompts_per_round: int) -> float:
        """Generation rounds in one pass over the prompts. As TRL's sampler does, an epoch is the whole rounds that
        fit (the last len % prompts_per_round prompts of each epoch's order are left out, a different few each
        shuffled epoch); a dataset smaller than one round is read round after round without a break."""
        n = len(self)
        return n // prompts_per_round if n >= prompts_per_round else n / prompts_per_round

    def stream_index(self, position: int, prompts_per_round: int, seed: int, shuffle: bool) -> int:
        """The dataset row at `position` of the prompt stream (round position // prompts_per_round, slot
        position % prompts_per_round) in the epoch-wise order; the stream starts `round_offset` rounds in."""
        position -= self.round_offset * prompts_per_round
        n = len(self)
        if n >= prompts_per_round:
            round_index, slot = divmod(position, prompts_per_round)
            epoch, round_in_epoch = divmod(round_index, n // prompts_per_round)
            offset = round_in_epoch * prompts_per_round + slot
        else:
            epoch, offset = divmod(position, n)
        return self.order(epoch, seed, shuffle)[offset]

    def round_prompts(self, round_index: int, prompts_per_round: int, seed: int, shuffle: bool) -> List[int]:
        """Dataset indices of round `round_index`'s prompts: consecutive positions of the prompt stream."""
        start = round_index * prompts_per_round
        return [
            self.stream_index(pos, prompts_per_round, seed, shuffle) for pos in range(start, start + prompts_per_round)
        ]

    @staticmethod
    def rank_slice(prompts: Sequence[int], num_generations: int, rank: int, world: int) -> RoundSlice:
        slots = [i for i in prompts for _ in range(num_generations)]
        per_rank = len(slots) // world
        mine = slots[rank * per_rank : (rank + 1) * per_rank]
        indices: List[int] = []
        counts: List[int] = []
        for pos, idx in enumerate(mine):
            # a new run starts where the prompt changes or a full group has been filled (a prompt may repeat)
            if indices and indices[-1] == idx and (rank * per_rank + pos) % num_generations != 0:
                counts[-1] += 1
            else:
                indices.append(idx)
                counts.append(1)
        return RoundSlice(indices, counts, rank * per_rank)

    def rows_for(self, indices: Sequence[int], counts: Sequence[int]):
        """(prompts, {column: values}) with one entry per completion; each dataset row is read once."""
        rows = [self.dataset[i] for i in indices]
        prompts = [r["prompt"] for r, n in zip(rows, counts) for _ in range(n)]
        return prompts, {c: [r[c] for r, n in zip(rows, counts) for _ in range(n)] for c in self.columns}


def check_prompt_length(field: str, row, n: int, max_prompt_length, context_length, max_completion_length) -> None:
    if max_prompt_length is not None and n > max_prompt_length:
        raise ValueError(
            f"{field}[{row}] has {n} prompt tokens, more than max_prompt_length="
            f"{max_prompt_length}. Raise max_prompt_length or filter long prompts out."
        )
    if context_length is not None and n + max_completion_length > context_length:
        raise ValueError(
            f"{field}[{row}] has {n} prompt tokens; with max_completion_length="
            f"{max_completion_length} that exceeds the generation context of {context_length} "
            "tokens. Raise vllm_max_model_length, lower max_completion_length, or filter long prompts."
        )


class StreamingPromptSource(PromptSource):
    """A `datasets.IterableDataset` read as a stream (TRL accepts those for train_dataset): nothing is tokenised up
    front; a round's rows are read and tokenised when the round asks for them, and only the current round's are
    kept. A stream position is the row's index (rows repeat when the stream is read again, epoch after epoch, in
    the stream's own order: shuffle_dataset does not apply). A resumed run reads the stream up to its round's
    position, so it samples what the interrupted run would have."""

    streaming = True

    def __init__(
        self,
        dataset,
        tokenizer,
        *,
        max_prompt_length: Optional[int],
        context_length: Optional[int],
        max_completion_length: int,
        chat_template_kwargs: Optional[dict] = None,
        field: str = "train_dataset",
        keep_columns: bool = True,
    ):
        self.dataset, self.field, self.tokenizer = dataset, field, tokenizer
        self.chat_template_kwargs = chat_template_kwargs or {}
        self.limits = (max_prompt_length, context_length, max_completion_length)
        self._iterator, self._position = None, 0  # the next row the stream gives has this position
        self._rows: Dict[int, dict] = {}  # position → row, the current round's
        self.prompt_ids = _LazyPromptIds(self)
        first = next(iter(dataset), None)
        if first is None:
            raise ValueError(f"{field} is empty: it needs at least one prompt.")
        if "prompt" not in first:
            raise ValueError(
                f"{field} has no 'prompt' column (columns: {sorted(first)}). Rename the column that "
                "holds the prompts to 'prompt'."
            )
        self.columns = [c for c in first if c != "prompt"] if keep_columns else []
        self.conversational = is_conversational(first["prompt"])
        if self.conversational and not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                f"{field} holds conversational prompts (lists of messages) but the tokenizer has no chat "
                "template. Pass a processing_class with a chat_template, or give plain-text prompts."
            )

    def identity(self) -> dict:
        return {"rows": None, "fingerprint": getattr(self.dataset, "_fingerprint", None)}

    def __len__(self) -> int:
        raise TypeError(
            f"{self.field} is an IterableDataset: it has no length (set max_steps; epoch-based "
            "strategies need a map-style datasets.Dataset)."
        )

    def round_prompts(self, round_index: int, prompts_per_round: int, seed: int, shuffle: bool) -> List[int]:
        round_index -= self.round_offset
        positions = list(range(round_index * prompts_per_round, (round_index + 1) * prompts_per_round))
        self._read(positions)
        return positions

    def _read(self, positions: Sequence[int]) -> None:
        """Rows at `positions` (increasing, from the current round on) into the cache; older rows dropped."""
        first = min(positions)
        self._rows = {p: r for p, r in self._rows.items() if p >= first}
        if self._iterator is None or first < self._position and first not in self._rows:
            self._iterator, self._position = iter(self.dataset), 0
        while self._position <= max(positions):
            try:
                row = next(self._iterator)
            except StopIteration:  # the end of one pass: the next epoch reads the stream again
                self._iterator = iter(self.dataset)
                row = next(self._iterator)
            if self._position >= first:
                self._rows[self._position] = dict(row, _ids=None)
            self._position += 1

    def row_ids(self, position: int) -> List[int]:
        row = self._rows[position]
        if row["_ids"] is None:
            row["_ids"] = self.tokenize([row["prompt"]])[0]
            check_prompt_length(self.field, position, len(row["_ids"]), *self.limits)
        return row["_ids"]

    def rows_for(self, indices: Sequence[int], counts: Sequence[int]):
        rows = [self._rows[i] for i in indices]
        prompts = [r["prompt"] for r, n in zip(rows, counts) for _ in range(n)]
        return prompts, {c: [r[c] for r, n in zip(rows, counts) for _ in range(n)] for c in self.columns}


class _LazyPromptIds:
    """prompt_ids[position] of a streaming source, tokenised on first use."""

    def __init__(self, source: StreamingPromptSource):
        self.source = source

    def __getitem__(self, position: int) -> List[int]:
        return self.source.row_ids(position)


def make_prompt_source(dataset, tokenizer, **kwargs) -> PromptSource:
    """A PromptSource for a map-style dataset, a StreamingPromptSource for an IterableDataset."""
    import datasets

    if isinstance(dataset, datasets.IterableDataset):
        return StreamingPromptSource(dataset, tokenizer, **kwargs)
    return PromptSource(dataset, tokenizer, **kwargs)


def completions_for_rewards(texts: Sequence[str], conversational: bool) -> list:
    """TRL hands conversational completions to reward functions as message lists."""
    if conversational:
        return [[{"role": "assistant", "content": t}] for t in texts]
    return list(texts)
