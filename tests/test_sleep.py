"""Sleep mode's state machine (rollout/sleep.py) against a fake vLLM LLM that refuses what a real one asleep at
level 2 cannot do: generate (no weights, no KV cache) or load weights before their memory is back. The real
engine's sleep needs a GPU; the transitions are the same."""

from types import SimpleNamespace

import pytest
import torch

from dsgrpo.rollout.base import SamplingConfig
from dsgrpo.rollout.sleep import EngineSleep
from dsgrpo.rollout.sources import GenerationSource
from dsgrpo.rollout.vllm_engine import VLLMGenerator


class SleepyLLM:
    def __init__(self):
        self.weights = self.kv_cache = True
        self.calls = []

    def sleep(self, level):
        assert level == 2
        self.weights = self.kv_cache = False
        self.calls.append("sleep")

    def wake_up(self, tags=None):
        for tag in tags or ["weights", "kv_cache"]:
            setattr(self, tag, True)
        self.calls.append(f"wake:{','.join(tags or ['all'])}")

    def generate(self, prompts, params, use_tqdm=False):
        if not (self.weights and self.kv_cache):
            raise RuntimeError("generate on a sleeping engine")
        self.calls.append("generate")
        step = {7: SimpleNamespace(logprob=-0.5)}
        return [
            SimpleNamespace(outputs=[SimpleNamespace(token_ids=[7], logprobs=[step], finish_reason="stop")] * p.n)
            for p in params
        ]

    def collective_rpc(self, method, kwargs=None):
        if not self.weights:
            raise RuntimeError("reload into discarded weight memory")
        if method == "reload_weights":
            list(kwargs["weights_iterator"])
            self.calls.append("reload")
        if callable(method):  # compat's questions to the one worker (its model has an lm_head, nothing to repack)
            return [
                method(
                    SimpleNamespace(
                        model_runner=SimpleNamespace(
                            get_model=lambda: SimpleNamespace(lm_head=None, modules=lambda: [])
                        )
                    )
                )
            ]

    def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")


def engine(enabled=True):
    gen = VLLMGenerator.__new__(VLLMGenerator)
    gen.llm = SleepyLLM()
    gen.sleep = EngineSleep(gen.llm, enabled=enabled)
    return gen


SAMPLING = SamplingConfig(max_tokens=4)


def test_a_round_generates_awake_sleeps_once_and_wakes_on_the_weight_load():
    gen = engine()
    for _ in range(3):  # tool turns / chunks: several calls in one round, none on a sleeping engine
        assert len(gen.generate([[1, 2]], [2], SAMPLING)) == 2
    gen.end_generation()
    assert gen.needs_weights() and gen.llm.calls[-1] == "sleep"
    with pytest.raises(RuntimeError, match="asleep at level 2.*load weights first"):
        gen.generate([[1]], [1], SAMPLING)  # refused by the state machine, before the engine sees it
    gen.load_weights([("w", torch.zeros(1))])
    assert not gen.needs_weights()
    assert gen.llm.calls[-4:] == ["wake:weights", "reload", "reset_prefix_cache", "wake:kv_cache"]
    assert len(gen.generate([[1]], [1], SAMPLING)) == 1
    gen.end_generation()
    gen.end_generation()  # idempotent
    assert gen.llm.calls.count("sleep") == 2


def test_without_sleep_mode_nothing_sleeps():
    gen = engine(enabled=False)
    gen.generate([[1]], [1], SAMPLING)
    gen.end_generation()
    assert not gen.needs_weights() and "sleep" not in gen.llm.calls
    gen.load_weights([("w", torch.zeros(1))])
    assert gen.llm.calls == ["generate", "reload", "reset_prefix_cache"]


class Prompts:
    prompt_ids = [[1, 2], [3]]

    def __len__(self):
        return len(self.prompt_ids)

    def round_prompts(self, round_index, n, order_seed, shuffle):
        return [0, 1][:n]


def source_with(gen, monkeypatch):
    """A GenerationSource around `gen` whose sampling is one generate call (the real samplers are tested elsewhere)."""

    setup = SimpleNamespace(
        generator=gen,
        sampler=None,
        prompts=Prompts(),
        prompts_per_round=2,
        tied=False,
        placement=SimpleNamespace(trainers=1),
        weight_sync=lambda module, g, version: g.load_weights([("w", torch.zeros(1))]),
    )
    args = SimpleNamespace(
        order_seed=0,
        shuffle_dataset=False,
        num_generations=2,
        weight_sync_bucket_bytes=1 << 20,
        per_device_eval_batch_size=4,
    )
    src = GenerationSource.__new__(GenerationSource)
    src.setup, src.args = setup, args
    src._sample = lambda prompts, rows, round_index, group, chunk=None: SimpleNamespace(
        rollout=gen.generate([prompts.prompt_ids[r] for r in rows], [group] * len(rows), SAMPLING)
    )
    return src


def test_the_source_sleeps_after_a_round_and_syncs_a_sleeping_engine_even_when_no_sync_is_due(monkeypatch):
    gen = engine()
    src = source_with(gen, monkeypatch)
    src.next_batch(0)
    assert gen.needs_weights()  # asleep while training runs
    src.sync_weights(None, 0, needed=True)  # the round's update
    src.next_batch(1)
    # after the last round (or a round without an optimizer step) the sync is skipped, but not for an engine that
    # discarded its weights: an evaluation (or the next round) after it generates on an awake engine
    src.sync_weights(None, 1, needed=False)
    assert not gen.needs_weights()
    src.evaluation_batch(Prompts(), group=1)
    assert gen.llm.calls.count("reload") == 2 and gen.llm.calls[-1] == "generate"
