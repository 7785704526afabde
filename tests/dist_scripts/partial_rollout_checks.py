"""Run under `torchrun --nproc_per_node 2`: partial rollouts (issue 46) on a real ZeRO-3 policy and real in-process
vLLM, fp32 on CPU, long-tailed completions (generation also stops at 13 token ids). Records per rank every round's
trained groups (positions, tokens, sampler log-probs, versions), the groups left in flight after each round, the
metrics, and a resumed run's first rounds; tests/test_partial_rollout_dist.py asserts on them.

Usage: torchrun --nproc_per_node 2 tests/dist_scripts/partial_rollout_checks.py OUT_DIR [CHECK,CHECK...]
"""

import io
import json
import os
import sys
import time
from contextlib import redirect_stdout

from datasets import Dataset

from dsgrpo import AsyncGRPOTrainer, GRPOTrainer, dist
from dsgrpo.rollout.choice import choose_source
from dsgrpo.rollout.partial_source import PartialRolloutSource
from dsgrpo.rollout.sources import GenerationSource
from dsgrpo.testing import tiny_model
from recorder import check_config, SHARDED_ZERO3, digit_fraction, recorder

OUT = sys.argv[1]
results = {}
check = recorder(results, set(sys.argv[2].split(",")) if len(sys.argv) > 2 else None)  # [CHECK,...]: a rerun by hand
prompts = Dataset.from_list([{"prompt": f"Count from {i} and keep going:"} for i in range(64)])
MODEL = tiny_model("qwen2")


config = check_config(
    OUT,
    max_steps=6,
    max_completion_length=48,
    learning_rate=3e-2,
    seed=11,
    deepspeed=SHARDED_ZERO3,
    vllm_kv_cache_bytes=64 * 2**20,
    report_to="none",
    save_strategy="no",
    lr_scheduler_type="linear",  # the schedule these checks were written with
    partial_rollout=True,
    rollout_overprovision=4,
    max_staleness=1,
    partial_rollout_adaptive=False,  # every round over-provisions: the checks need carried groups
    generation_kwargs={"stop_token_ids": list(range(100, 140))},
)  # stops at 40 of 1,024 ids


def recording(trainer):
    """Wrap the source's next_batch: each round's trained groups (by stream position) and those left in flight."""
    source, rounds = trainer.source, []

    def next_batch(round_index, inner=source.next_batch):
        before = {p: [list(c.tokens) for c in g.members] for p, g in source.inflight.groups.items()}
        version = trainer.generator.weight_version
        batch = inner(round_index)
        r, G = batch.rollout, trainer.args.num_generations
        groups = {}
        for j, position in enumerate(source.last_positions):
            rows = slice(j * G, (j + 1) * G)
            groups[str(position)] = {
                "prompt": r.prompt_ids[j * G],
                "completions": r.completion_ids[rows],
                "logprobs": r.sampler_logprobs[rows],
                "versions": r.weight_versions[rows],
                "truncated": r.truncated[rows],
            }
        rounds.append(
            {
                "round": round_index,
                "version": version,
                "groups": groups,
                "before": {str(p): v for p, v in before.items()},
                "after": {str(p): [list(c.tokens) for c in g.members] for p, g in source.inflight.groups.items()},
                "metrics": {k: v for k, v in batch.metrics.items() if k.startswith(("partial/", "rollout/"))},
            }
        )
        return batch

    source.next_batch = next_batch
    return rounds


@check("option_off_is_the_plain_source")
def _():
    return {
        "off": choose_source(config("x", partial_rollout=False), GRPOTrainer.rollout_source).__name__,
        "on": choose_source(config("x"), GRPOTrainer.rollout_source).__name__,
        "plain": GenerationSource.__name__,
        "partial": PartialRolloutSource.__name__,
    }


@check("run")
def _():
    args = config("run", save_strategy="steps", save_steps=3)
    t = GRPOTrainer(MODEL, digit_fraction, args=args, train_dataset=prompts)
    rounds = recording(t)
    t.train()
    rows = [h for h in t.state.log_history if "loss" in h and "partial/groups_in_flight" in h]
    keys = ("partial/", "sampling/", "rollout/weight_version")
    return {
        "rounds": rounds,
        "share": t.source.share,
        "history": [{k: v for k, v in h.items() if k.startswith(keys)} for h in rows],
        "in_flight_at_end": sorted(t.source.inflight.groups),
    }


@check("resumed")
def _():
    saved = os.path.join(OUT, "run", "checkpoint-3")
    state = json.load(open(os.path.join(saved, f"rollout_state_{dist.rank()}.json")))
    args = config("run", resume_from_checkpoint=saved, save_strategy="no")
    printed = io.StringIO()
    with redirect_stdout(printed):
        t = GRPOTrainer(MODEL, digit_fraction, args=args, train_dataset=prompts)
        rounds = recording(t)
        t.train()
    return {"saved": state, "rounds": rounds, "printed": printed.getvalue()}


def completions_and_losses(args):
    """Each round's completion ids and sampler log-probs on this rank, the logged losses and partial/* metrics."""
    t = GRPOTrainer(MODEL, digit_fraction, args=args, train_dataset=prompts)
    rounds = []

    def next_batch(round_index, inner=t.source.next_batch):
        batch = inner(round_index)
        rounds.append(
            {
                "completions": batch.rollout.completion_ids,
                "logprobs": batch.rollout.sampler_logprobs,
                "metrics": {k: v for k, v in batch.metrics.items() if k.startswith("partial/")},
            }
        )
        return batch

    t.source.next_batch = next_batch
    t.train()
    return {"rounds": rounds, "losses": [h["loss"] for h in t.state.log_history if "loss" in h]}


@check("adaptive_even_lengths")
def _():
    """Completions all about max_completion_length long (no stop ids): no tail, so the adaptive partial source samples
    every round as a plain batch, which must be what partial_rollout=False samples, token for token."""
    even = dict(max_steps=3, max_completion_length=8, generation_kwargs={})
    return {
        "plain": completions_and_losses(config("even_plain", partial_rollout=False, **even)),
        "adaptive": completions_and_losses(config("even_adaptive", partial_rollout_adaptive=True, **even)),
    }


@check("adaptive_long_tail")
def _():
    """The long-tailed workload (stops at 40 ids, up to 96 tokens): the first round is plain and finds the tail, the
    rounds after it over-provision and cut."""
    return completions_and_losses(
        config("tail_adaptive", partial_rollout_adaptive=True, max_steps=4, max_completion_length=96)
    )


def recording_async(trainer):
    """Wrap the async source's next_batch: each round's trained positions (the batch plan) and its rows."""
    source, rounds = trainer.source, []

    def next_batch(round_index, inner=source.next_batch):
        batch = inner(round_index)
        r, G = batch.rollout, trainer.args.num_generations
        positions = source.last_plan.trained_on(dist.rank())
        groups = {
            str(p): {
                "completions": r.completion_ids[j * G : (j + 1) * G],
                "versions": r.weight_versions[j * G : (j + 1) * G],
            }
            for j, p in enumerate(positions)
        }
        rounds.append(
            {
                "round": round_index,
                "groups": groups,
                "metrics": {k: v for k, v in batch.metrics.items() if k.startswith(("partial/", "async/"))},
            }
        )
        return batch

    source.next_batch = next_batch
    return rounds


class HoldTheWorkerMidGroup:
    """At the checkpoint's step, after the sync opened the staleness window again: let this rank's async worker step
    until it holds an unfinished completion with tokens, then keep it still until the checkpoint is written. A worker
    faster than training may otherwise have finished every group its window allows, and the checkpoint would have
    nothing in flight to carry (what the async checkpoint test is about). A rank whose worker holds nothing while
    the staleness window has no position left to claim (the other rank took the window's new groups) goes on. (It
    once went on after 0.5 s of holding nothing: a worker slow to claim on a busy machine left both ranks with
    nothing in flight, 1 run in 3.)"""

    def __init__(self, trainer, step: int):
        self.trainer, self.step, self.held = trainer, step, None

    def on_step_end(self, args, state, control, **kw):
        if state.global_step != self.step:
            return
        w = self.trainer.source.exchange.worker
        deadline = time.monotonic() + 60
        per_round = w.stream.P if w.balanced else w.stream.per_rank
        while time.monotonic() < deadline:
            with w._pause_lock:
                w._pause_requests += 1  # the worker takes no further engine step ...
            with w._work:  # ... once the one it is in has ended
                mid_group = any(c.tokens and not c.finished for g in w.inflight.groups.values() for c in g.members)
                empty = not w.inflight.groups
                window_claimed = w.counter.add("claimed", 0) >= (
                    w.version + w.max_staleness + 1
                ) * per_round + w.counter.add("dropped", 0)
            if mid_group:
                self.held = w
                return
            with w._pause_lock:
                w._pause_requests -= 1
            if empty and window_claimed:
                return
            time.sleep(0.005)

    def on_save(self, args, state, control, **kw):
        if self.held is not None:
            with self.held._pause_lock:
                self.held._pause_requests -= 1
            self.held = None


class MixVersionsAtASync:
    """Make sure a weight sync stops a completion that then finishes on the new weights, and that its group is
    trained. Left to timing, a group in flight at a sync could finish after a younger group of the next version,
    the cut took its batch without it, and a round later it was too stale to train (no mixed-version group trained:
    1 run in 3 on a busy machine). So, right after a batch cut: hold the worker still and list the groups of the
    current version r, pooled or in flight (every rank's: a collective). A group held mid-completion now goes on
    with version r + 1's weights after the sync, and the next cut takes the oldest groups, by (version, position):
    with the worker held until the sync no other group of version r can appear, so the in-flight group G with the
    lowest position is taken if fewer than a batch's groups of version r come before it. Then hold the worker
    through the sync and, before the next cut, wait until G is pooled. Otherwise let the worker go and try again
    after the next cut (in practice the first try holds)."""

    def __init__(self, trainer):
        self.trainer, self.held, self.waiting, self.done = trainer, False, None, False
        source = trainer.source
        self.worker, self.pool = source.exchange.worker, source.exchange.pool
        inner_cut, inner_sync = source.exchange.cut, source.sync_weights

        def cut(round_index):
            self._wait_for_the_held_group()
            out = inner_cut(round_index)
            if not self.done and round_index + 1 < trainer.state.max_steps:
                self._try_to_hold()
            return out

        def sync_weights(*a, **k):
            inner_sync(*a, **k)
            if self.held:  # the new weights are in: the stopped completions go on with them
                self._release()

        source.exchange.cut, source.sync_weights = cut, sync_weights

    def _release(self):
        with self.worker._pause_lock:
            self.worker._pause_requests -= 1
        self.held = False

    def _try_to_hold(self):
        w = self.worker
        with w._pause_lock:
            w._pause_requests += 1  # the worker takes no further engine step ...
        with w._work:  # ... once the one it is in has ended
            version = w.version  # (a member whose oldest token is older starts again: it is younger then)
            mine = [
                (p, any(c.versions and min(c.versions) == version and not c.finished for c in g.members))
                for p, g in w.inflight.groups.items()
                if any(c.versions and min(c.versions) == version for c in g.members)
            ]
            mine += [(p, False) for p, g in self.pool.groups.items() if g.version == version]
        ranks = dist.all_gather_object(mine, group=dist.EVERYONE)
        everyone = sorted((p, mid, r) for r, part in enumerate(ranks) for p, mid in part)
        first_mid = next((i for i, (_, mid, _) in enumerate(everyone) if mid), None)
        if first_mid is not None and first_mid < self.trainer.prompts_per_round:
            position, _, rank = everyone[first_mid]
            self.held, self.done = True, True
            self.waiting = position if rank == dist.rank(dist.EVERYONE) else None
        else:
            self._release()

    def _wait_for_the_held_group(self):
        deadline = time.monotonic() + 120
        while self.waiting is not None and time.monotonic() < deadline:
            with self.worker._work:
                if self.waiting not in self.worker.inflight.groups:
                    self.waiting = None  # pooled: the next cut takes it
            time.sleep(0.005)


@check("async")
def _():
    args = config("async", save_strategy="steps", save_steps=3, async_chunk_groups=1)
    t = AsyncGRPOTrainer(MODEL, digit_fraction, args=args, train_dataset=prompts)
    t.add_callback(HoldTheWorkerMidGroup(t, step=3))
    MixVersionsAtASync(t)
    rounds = recording_async(t)
    t.train()
    rows = [h for h in t.state.log_history if "loss" in h]
    keys = ("partial/", "sampling/", "async/staleness", "rollout/")
    saved = json.load(open(os.path.join(OUT, "async", "checkpoint-3", f"rollout_state_{dist.rank()}.json")))
    return {
        "rounds": rounds,
        "history": [{k: v for k, v in h.items() if k.startswith(keys)} for h in rows],
        "saved_in_flight": saved.get("in_flight"),
        "saved_pool": [g["position"] for g in saved["pool"]],
    }


@check("async_resumed")
def _():
    saved = os.path.join(OUT, "async", "checkpoint-3")
    args = config("async", resume_from_checkpoint=saved, save_strategy="no", async_chunk_groups=1)
    t = AsyncGRPOTrainer(MODEL, digit_fraction, args=args, train_dataset=prompts)
    rounds = recording_async(t)
    t.train()
    return {"rounds": rounds}


with open(os.path.join(OUT, f"result-{dist.rank()}.json"), "w") as fh:
    json.dump(results, fh)
dist.barrier("results written")

from dsgrpo.process_exit import leave  # noqa: E402

leave(0)  # out without the interpreter's teardown (dsgrpo/process_exit.py): 2.5 s a rank
