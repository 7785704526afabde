"""Run under `torchrun --nproc_per_node 2`: GRPOTrainer's and AsyncGRPOTrainer's `tools` and `rollout_func`, and
TrainerControl flags set by a callback, on real DeepSpeed ZeRO-3 and real in-process vLLM (fp32, CPU). Each check
records numbers in OUT_DIR/result-<rank>.json; tests/test_api_dist.py asserts on them.

Usage: torchrun --nproc_per_node 2 tests/dist_scripts/api_checks.py OUT_DIR TOOL_MODEL
(TOOL_MODEL: a tiny model fine-tuned to call the tools below; tests/test_api_dist.py builds it.)
"""

import json
import os
import sys
import time

from datasets import Dataset

from dsgrpo import AsyncGRPOTrainer, GRPOTrainer, dist
from api_checks_tools import TOOLS
from recorder import (
    check_config,
    SHARDED_ZERO3,
    after_each_sync,
    calls_the_engine_sampled,
    conformance,
    digit_fraction,
    recorder,
    spy_batches,
    spy_engine,
    training_rows,
)
from dsgrpo.testing import Ledger, tiny_model

OUT, TOOL_MODEL = sys.argv[1], sys.argv[2]
ONLY = set(sys.argv[3].split(",")) if len(sys.argv) > 3 else None  # a developer's run of some checks
results, KEEP = {}, []


check = recorder(results, ONLY)
DS = SHARDED_ZERO3


config = check_config(OUT, max_steps=2, learning_rate=1e-4, seed=3, deepspeed=DS, vllm_kv_cache_bytes=64 * 2**20)


# ------------------------------------------------------------------ 1. tools: a calculator through vLLM
TOOL_PROMPTS = ["What is 2 plus 3?", "Make it explode.", "Wait for me."]


saw_tool_messages = []


def tool_reward(prompts, completions, **kwargs):
    """1 when the completion (tool turns included) holds the right sum. Records, per completion, whether it came
    as TRL's message list and whether a tool result is in it."""
    saw_tool_messages.extend(
        (isinstance(c, list), isinstance(c, list) and any(m.get("role") == "tool" for m in c)) for c in completions
    )
    return [1.0 if "5" in str(c) else 0.0 for c in completions]


def tool_rows(trainer, batches):
    """What the checks assert of a tool run's trained batches: inserted tokens, their log-probs and the loss mask
    of every micro-batch (tool-result tokens left out)."""
    rows = []
    tok = trainer.tokenizer
    for batch in batches:
        r = batch.rollout
        for i in range(len(r)):
            mask = r.tool_mask[i] if r.tool_mask else [1] * len(r.completion_ids[i])
            inserted = [t for t, m in zip(r.completion_ids[i], mask) if m == 0]
            sampled_lp = [lp for lp, m in zip(r.sampler_logprobs[i], mask) if m == 0]
            rows.append(
                {
                    "text": tok.decode(r.completion_ids[i]),
                    "inserted": tok.decode(inserted),
                    "n_inserted": len(inserted),
                    "inserted_logprobs_zero": all(lp == 0.0 for lp in sampled_lp),
                    "length": len(r.completion_ids[i]),
                    "truncated": r.truncated[i],
                }
            )
        expected = [sum(r.tool_mask[i]) if r.tool_mask else len(r.completion_ids[i]) for i in range(len(r))]
        got = [s for mb in batch.micro for s in mb["completion_mask"].sum(1).tolist()]
        rows[-1]["mask_matches"] = got == expected
    return rows


@check("tools")
def _():
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": TOOL_PROMPTS[i % 3]}]} for i in range(12)])
    trainer = GRPOTrainer(
        TOOL_MODEL,
        tool_reward,
        train_dataset=data,
        tools=TOOLS,
        args=config(
            "tools",
            max_completion_length=96,
            temperature=0.3,
            max_tool_calling_iterations=2,
            tool_timeout_s=0.5,
            shuffle_dataset=False,
        ),
    )
    KEEP.append(trainer)
    verdict = conformance(trainer)  # issue 66: the same checks on every path
    batches = spy_batches(trainer)
    start = time.perf_counter()
    trainer.train()
    tok = trainer.tokenizer
    return {
        "conformance": verdict(),
        "history": training_rows(trainer),
        "rows": tool_rows(trainer, batches),
        "seconds": time.perf_counter() - start,
        "prompt_shows_tools": "<tools>" in tok.decode(trainer.train_prompts.prompt_ids[0]),
    }


# ------------------------------------------------------------------ 1b. environment_factory: the same tools, as an
#                                                                    environment's methods
environments_seen = []


def environment_reward(completions, environments, **kwargs):
    """Records what reward functions receive: one environment per completion, each its own instance."""
    environments_seen.append(
        [len(environments) == len(completions), len({id(e) for e in environments}) == len(completions)]
    )
    return [0.0] * len(completions)


@check("environments")
def _():
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": TOOL_PROMPTS[i % 3]}]} for i in range(12)])
    trainer = GRPOTrainer(
        TOOL_MODEL,
        environment_reward,
        train_dataset=data,
        environment_factory=Ledger,
        args=config(
            "environments",
            max_completion_length=96,
            temperature=0.3,
            max_tool_calling_iterations=2,
            tool_timeout_s=0.5,
            shuffle_dataset=False,
        ),
    )
    KEEP.append(trainer)
    verdict = conformance(trainer)  # issue 66: the same checks on every path
    batches = spy_batches(trainer)
    trainer.train()
    last = trainer.environments
    counts = batches[-1].rollout.tool_counts
    return {
        "conformance": verdict(),
        "history": training_rows(trainer),
        "rows": tool_rows(trainer, batches),
        "reward_names": trainer.reward_func_names,
        "weights": trainer.reward_weights.tolist(),
        "instances": len(last),
        "distinct": len({id(e) for e in last}),
        "batch_rows": len(batches[-1].rollout),
        "env_adds": sum(len(e.calls) for e in last),
        "answered_calls": sum(c[0] - c[1] for c in counts),
        "env_prompts_match": [e.prompt for e in last] == [p[-1]["content"] for p in batches[-1].prompts],
        "own_rewards": [float(e.total == 5) for e in last],
        "seen": environments_seen,
    }


# ------------------------------------------------------------------ 1c. adapters: TextArena's games and OpenEnv
@check("adapters")
def _():
    """dsgrpo.adapters through the trainer, as one dict of environments: half the rows play a TextArena game, half an
    OpenEnv environment in-process (the tool model does not know `act`: what is checked is the path, each row's
    game dealt into its prompt and each class's score as its own reward)."""
    from dsgrpo.adapters.openenv_example import GuessNumber
    from dsgrpo.adapters.textarena import TextArenaGame
    from dsgrpo.tasks import TASKS

    games = TASKS["textarena"]("GuessTheNumber-v0,TowerOfHanoi-v0").select(range(16))
    rows = [dict(row, environment="textarena" if i % 2 == 0 else "openenv") for i, row in enumerate(games)]
    trainer = GRPOTrainer(
        TOOL_MODEL,
        train_dataset=Dataset.from_list(rows),
        args=config("adapters", max_completion_length=64, max_tool_calling_iterations=2, shuffle_dataset=False),
        environment_factory={"textarena": TextArenaGame, "openenv": GuessNumber},
    )
    KEEP.append(trainer)
    verdict = conformance(trainer)  # issue 66: the same checks on every path
    batches = spy_batches(trainer)
    trainer.train()
    last = trainer.environments
    return {
        "conformance": verdict(),
        "history": training_rows(trainer),
        "reward_names": trainer.reward_func_names,
        "prompts": [trainer.tokenizer.decode(ids) for b in batches for ids in b.rollout.prompt_ids],
        "kinds": [type(e).__name__ for e in last],
        "rewards": [e.get_reward() for e in last],
    }


# ------------------------------------------------------------------ 2. rollout_func: bring your own generation
tags_seen = []


def tagged_reward(prompts, completions, tag, **kwargs):
    tags_seen.extend(tag)
    return [len(c) / 10.0 for c in completions]


def my_rollout(prompts, trainer):
    """Generates with the trainer's own colocated vLLM and adds a per-row column."""
    from vllm import SamplingParams

    ids = [trainer.tokenizer(p)["input_ids"] for p in prompts]
    params = SamplingParams(max_tokens=8, temperature=1.0, logprobs=0, seed=7)
    outs = trainer.generator.llm.generate([{"prompt_token_ids": i} for i in ids], params, use_tqdm=False)
    completions = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [[step[t].logprob for step, t in zip(o.outputs[0].logprobs, c)] for o, c in zip(outs, completions)]
    return {
        "prompt_ids": ids,
        "completion_ids": completions,
        "logprobs": logprobs,
        "tag": [f"rank{dist.rank()}-row{i}" for i in range(len(prompts))],
    }


@check("rollout_func")
def _():
    data = Dataset.from_list([{"prompt": f"Write some numbers {i}:"} for i in range(32)])
    trainer = GRPOTrainer(
        tiny_model("qwen2"),
        tagged_reward,
        train_dataset=data,
        rollout_func=my_rollout,
        args=config("rollout_func", max_completion_length=8),
    )
    KEEP.append(trainer)
    trainer.train()
    errors = {}
    for name, bad in {
        "missing": lambda p, t: {"prompt_ids": [[1]] * len(p), "completion_ids": [[2]] * len(p)},
        "short": lambda p, t: {**my_rollout(p, t), "logprobs": [[0.0]] * len(p)},
        "not_a_dict": lambda p, t: [1, 2, 3],
    }.items():
        trainer.sampler.rollout_func = bad
        try:
            trainer.source.next_batch(0)
            errors[name] = None
        except (ValueError, TypeError) as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"
    return {"history": training_rows(trainer), "tags": tags_seen, "errors": errors}


# ------------------------------------------------------------------ 3. AsyncGRPOTrainer with tools
@check("async_tools")
def _():
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": TOOL_PROMPTS[i % 3]}]} for i in range(12)])
    saw_tool_messages.clear()
    trainer = AsyncGRPOTrainer(
        TOOL_MODEL,
        tool_reward,
        train_dataset=data,
        tools=TOOLS,
        args=config(
            "async_tools",
            max_steps=3,
            max_completion_length=160,
            temperature=0.3,
            max_tool_calling_iterations=2,
            tool_timeout_s=0.5,
            shuffle_dataset=False,
            max_staleness=1,
            async_chunk_groups=1,
        ),
    )
    KEEP.append(trainer)
    verdict = conformance(trainer)  # issue 66: the same checks on every path
    batches = spy_batches(trainer)
    trainer.train()
    return {
        "conformance": verdict(),
        "history": training_rows(trainer),
        "rows": tool_rows(trainer, batches),
        "rewards_saw_lists": sum(a for a, _ in saw_tool_messages),
        "rewards_saw_tool_results": sum(b for _, b in saw_tool_messages),
        "rewards_rows": len(saw_tool_messages),
    }


@check("async_environments")
def _():
    """AsyncGRPOTrainer with environments: the worker thread acts and scores them; the trainer trains the groups."""
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": TOOL_PROMPTS[i % 3]}]} for i in range(12)])
    environments_seen.clear()
    trainer = AsyncGRPOTrainer(
        TOOL_MODEL,
        environment_reward,
        train_dataset=data,
        environment_factory=Ledger,
        args=config(
            "async_environments",
            max_steps=2,
            max_completion_length=96,
            temperature=0.3,
            max_tool_calling_iterations=2,
            tool_timeout_s=0.5,
            shuffle_dataset=False,
            max_staleness=1,
            async_chunk_groups=1,
        ),
    )
    KEEP.append(trainer)
    verdict = conformance(trainer)  # issue 66: the same checks on every path
    batches = spy_batches(trainer)
    trainer.train()
    return {
        "conformance": verdict(),
        "history": training_rows(trainer),
        "rows": tool_rows(trainer, batches),
        "seen": environments_seen,
        "reward_names": trainer.reward_func_names,
    }


# ------------------------------------------------------------------ 3b. environments with partial rollouts
def episodes_across_rounds(batches):
    """Per trained batch: its rows' episodes against their environments (every answered add is in the instance's
    state, so an episode carried over a sync kept its instance), and the rows whose tool turn was answered in an
    earlier round than tokens sampled after it (an episode that went on after the sync)."""
    out = []
    for batch in batches:
        r = batch.rollout
        envs = (r.columns or {}).get("environments")  # (a group stolen from another rank left its instances there)
        answered = [c[0] - c[1] for c in r.tool_counts]
        crossed = 0
        for mask, versions in zip(r.tool_mask, r.weight_versions):
            inserted = [v for v, m in zip(versions, mask) if m == 0]
            crossed += bool(inserted) and max(versions) > min(inserted)
        out.append(
            {
                "rows": len(r),
                "answered": answered,
                "mixed": sum(len(set(v)) > 1 for v in r.weight_versions),
                "crossed": crossed,
                **(
                    {
                        "instances": len({id(e) for e in envs}),
                        "env_adds": [len(e.calls) for e in envs],
                        "own_rewards": [float(e.total == 5) for e in envs],
                    }
                    if envs
                    else {}
                ),
            }
        )
    return out


def partial_environment_run(name, trainer_class, **settings):
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": TOOL_PROMPTS[i % 3]}]} for i in range(48)])
    environments_seen.clear()
    trainer = trainer_class(
        TOOL_MODEL,
        environment_reward,
        train_dataset=data,
        environment_factory=Ledger,
        args=config(
            name,
            max_steps=4,
            max_completion_length=192,
            temperature=0.3,
            max_tool_calling_iterations=2,
            tool_timeout_s=0.5,
            shuffle_dataset=False,
            partial_rollout=True,
            partial_rollout_adaptive=False,
            rollout_overprovision=8,
            max_staleness=2,
            **settings,
        ),
    )
    KEEP.append(trainer)
    verdict = conformance(trainer)  # issue 66: the same checks on every path
    batches = spy_batches(trainer)
    trainer.train()
    return {
        "conformance": verdict(),
        "history": training_rows(trainer),
        "rows": tool_rows(trainer, batches),
        "seen": list(environments_seen),
        "batches": episodes_across_rounds(batches),
        "reward_names": trainer.reward_func_names,
    }


@check("partial_environments")
def _():
    """partial_rollout=True with an environment: rounds cut episodes mid-way; they go on after the sync with their
    environments alive."""
    return partial_environment_run("partial_environments", GRPOTrainer, save_steps=3)


@check("partial_environments_resumed")
def _():
    """The run above saved at step 3 with episodes in flight: resumed, they start again from reset (said once), so
    no trained token predates the resumed weights."""
    import contextlib
    import io

    saved = os.path.join(OUT, "partial_environments", "checkpoint-3")
    state = json.load(open(os.path.join(saved, f"rollout_state_{dist.rank()}.json")))["partial_rollout"]["in_flight"]
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": TOOL_PROMPTS[i % 3]}]} for i in range(48)])
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        trainer = GRPOTrainer(
            TOOL_MODEL,
            environment_reward,
            train_dataset=data,
            environment_factory=Ledger,
            args=config(
                "partial_environments",
                max_steps=4,
                max_completion_length=192,
                temperature=0.3,
                max_tool_calling_iterations=2,
                tool_timeout_s=0.5,
                shuffle_dataset=False,
                partial_rollout=True,
                partial_rollout_adaptive=False,
                rollout_overprovision=8,
                max_staleness=2,
                resume_from_checkpoint=saved,
                save_steps=10**6,
            ),
        )
        KEEP.append(trainer)
        batches = spy_batches(trainer)
        trainer.train()
    return {
        "saved_tokens": sum(len(c["tokens"]) for g in state for c in g["members"]),
        "saved_groups": len(state),
        "said": [line for line in printed.getvalue().splitlines() if "starts again from reset" in line],
        "versions": [min(min(v) for v in b.rollout.weight_versions) for b in batches],
        "batches": episodes_across_rounds(batches),
        "steps": trainer.state.global_step,
    }


@check("async_partial_environments")
def _():
    return partial_environment_run("async_partial_environments", AsyncGRPOTrainer, async_chunk_groups=1)


# ------------------------------------------------------------------ 4. rollout_func under AsyncGRPOTrainer
async_tags_seen = []


def tagged_reward_async(prompts, completions, tag, **kwargs):
    async_tags_seen.extend(tag)
    return [len(c) / 10.0 for c in completions]


@check("async_rollout_func")
def _():
    data = Dataset.from_list([{"prompt": f"Write some numbers {i}:"} for i in range(32)])
    trainer = AsyncGRPOTrainer(
        tiny_model("qwen2"),
        tagged_reward_async,
        train_dataset=data,
        rollout_func=my_rollout,
        args=config("async_rollout_func", max_steps=3, max_completion_length=8),
    )
    KEEP.append(trainer)
    verdict = conformance(trainer)  # issue 66: the same checks on every path
    batches = spy_batches(trainer)
    trainer.train()
    return {
        "conformance": verdict(),
        "history": training_rows(trainer),
        "tags_seen": async_tags_seen,
        "trained_tags": [b.columns["tag"] for b in batches],
        "trained_rows": [len(b.rollout) for b in batches],
    }


# ------------------------------------------------------------------ 5. TrainerControl flags set by a callback
class Steering:
    """Asks for a checkpoint at step 2 (on rank 1 only), an evaluation and a log line at step 3, and a stop at step 4
    (on rank 0 only): what one rank asks, every rank does."""

    def __init__(self):
        self.logged, self.evaluated, self.saved = [], [], []

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 2 and dist.rank() == 1:
            control.should_save = True
        if state.global_step == 3:
            control.should_evaluate = control.should_log = True
        if state.global_step == 4 and dist.rank() == 0:
            control.should_training_stop = True
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logged.append(state.global_step)

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self.evaluated.append([state.global_step, metrics["eval_reward"]])

    def on_save(self, args, state, control, checkpoint=None, **kwargs):
        self.saved.append([state.global_step, checkpoint])


@check("control")
def _():
    data = Dataset.from_list([{"prompt": f"Write some numbers {i}:"} for i in range(32)])
    steering = Steering()
    out = os.path.join(OUT, "control")
    trainer = GRPOTrainer(
        tiny_model("qwen2"),
        digit_fraction,
        train_dataset=data,
        eval_dataset=data.select(range(4)),
        callbacks=[steering],
        args=config("control", max_steps=10, logging_steps=100, max_completion_length=8, eval_strategy="no"),
    )
    KEEP.append(trainer)
    trainer.train()
    records = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))] if dist.is_main() else []
    logged_lines = [[r["step"], "eval_reward" in r] for r in records]
    return {
        "steps": trainer.state.global_step,
        "logged": steering.logged,
        "evaluated": steering.evaluated,
        "saved": steering.saved,
        "checkpoints": sorted(n for n in os.listdir(out) if n.startswith("checkpoint-")),
        "model_saved": os.path.isfile(os.path.join(out, "config.json")),
        "metric_lines": logged_lines,
    }


# ------------------------------------------------------------------ 6. the best checkpoint (metric_for_best_model)
STEP = {"now": 0}


class StepWatch:
    def on_step_end(self, args, state, control, **kwargs):
        STEP["now"] = state.global_step


def step_reward(prompts, completions, **kwargs):
    """10 after step 2, 0 after steps 1 and 3, -10 after 4: the same for every completion of a round (no
    advantage), so evaluations rank the checkpoints by it while digit_fraction does the training."""
    return [10.0 * (1 - abs(STEP["now"] - 2))] * len(completions)


def safetensors_of(folder):
    from safetensors.torch import load_file

    return load_file(os.path.join(folder, "model.safetensors"))


@check("best_model")
def _():
    from dsgrpo import checkpoint

    data = Dataset.from_list([{"prompt": f"Write some numbers {i}:"} for i in range(32)])
    out = os.path.join(OUT, "best")
    common = dict(
        learning_rate=1e-2,
        max_completion_length=8,
        eval_strategy="steps",
        eval_steps=1,
        save_steps=1,
        save_total_limit=1,
        load_best_model_at_end=True,
        metric_for_best_model="rewards/step_reward/mean",
        eval_pass_at_k=[1, 2, 4],
        eval_correctness_reward="digit_fraction",
        eval_correct_threshold=0.5,
        eval_maj_at_k=[1, 4],
    )
    trainer = GRPOTrainer(
        tiny_model("qwen2"),
        [digit_fraction, step_reward],
        train_dataset=data,
        eval_dataset=data.select(range(4)),
        callbacks=[StepWatch()],
        args=config("best", max_steps=4, **common),
    )
    KEEP.append(trainer)
    trainer.train()
    first = {
        "evals": [h for h in trainer.state.log_history if "eval_reward" in h],
        "best": trainer.state.best_model_checkpoint,
        "best_step": trainer.state.best_global_step,
        "best_metric": trainer.state.best_metric,
        "checkpoints": sorted(n for n in os.listdir(out) if n.startswith("checkpoint-")),
    }
    # resumed for a fifth step (-20 after it): the record carries over and checkpoint-2 is still spared
    resumed = GRPOTrainer(
        tiny_model("qwen2"),
        [digit_fraction, step_reward],
        train_dataset=data,
        eval_dataset=data.select(range(4)),
        callbacks=[StepWatch()],
        args=config("best", max_steps=5, resume_from_checkpoint=os.path.join(out, "checkpoint-4"), **common),
    )
    KEEP.append(resumed)
    resumed.train()
    result = {
        **first,
        "resumed_best": resumed.state.best_model_checkpoint,
        "resumed_checkpoints": sorted(n for n in os.listdir(out) if n.startswith("checkpoint-")),
    }
    # the final model is checkpoint-2's weights, not the last step's (every rank calls export: the checksum check
    # it starts with is collective when a process group exists; rank 0's folders are read)
    best = checkpoint.export(os.path.join(out, "checkpoint-2"), os.path.join(OUT, f"best_export_2_{dist.rank()}"))
    last = checkpoint.export(os.path.join(out, "checkpoint-5"), os.path.join(OUT, f"best_export_5_{dist.rank()}"))
    if dist.is_main():
        final, best_w, last_w = safetensors_of(out), safetensors_of(best), safetensors_of(last)
        result["final_vs_best"] = max((final[k] - best_w[k]).abs().max().item() for k in best_w)
        result["final_vs_last"] = max((final[k] - last_w[k]).abs().max().item() for k in last_w)
    return result


@check("resume_guards")
def _():
    """Resuming with another train dataset, another reward list, and reset_data_position (issue 48)."""
    import contextlib
    import io

    first = Dataset.from_list([{"prompt": f"Count {i}:"} for i in range(16)])
    other = Dataset.from_list([{"prompt": f"Spell word {i}:"} for i in range(24)])
    common = dict(max_completion_length=4, save_steps=2, shuffle_dataset=False)
    out = os.path.join(OUT, "guards")
    t = GRPOTrainer(tiny_model("qwen2"), digit_fraction, train_dataset=first, args=config("guards", **common))
    KEEP.append(t)
    t.train()
    saved = os.path.join(out, "checkpoint-2")

    def resumed(dataset, rewards, **kw):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            r = GRPOTrainer(
                tiny_model("qwen2"),
                rewards,
                train_dataset=dataset,
                args=config(
                    "guards", max_steps=3, resume_from_checkpoint=saved, **{**common, "save_steps": 10**6}, **kw
                ),
            )
            KEEP.append(r)
            seen = spy_batches(r)
            r.train()
        return {
            "said": [l for l in err.getvalue().splitlines() if l.startswith("dsgrpo: resuming")],
            "prompts": sorted(set(seen[0].prompts)),
            "offset": r.train_prompts.round_offset,
        }

    same = resumed(first, digit_fraction)
    changed = resumed(other, digit_fraction)
    reset = resumed(other, digit_fraction, reset_data_position=True)
    alias = resumed(other, digit_fraction, ignore_data_skip=True)
    rewards = resumed(first, [digit_fraction, digit_fraction], reward_weights=[1.0, 0.5])
    return {"same": same, "changed": changed, "reset": reset, "alias": alias, "rewards": rewards}


SEEN_COMPLETIONS = []


def seen_completions(prompts, completions, **kwargs):
    """Records every completion it scores (a reward of 0, so it never moves training)."""
    SEEN_COMPLETIONS.extend(str(c) for c in completions)
    return [0.0] * len(completions)


@check("eval_rng_and_greedy")
def _():
    """A run that evaluates after every step trains exactly as one that never evaluates; greedy evaluation
    (eval_do_sample=False) draws the same completions whatever the seed, where sampled evaluation does not."""
    data = Dataset.from_list([{"prompt": f"Write some numbers {i}:"} for i in range(32)])
    runs = {}
    for name, extra in (
        ("no_eval", {}),
        ("greedy_eval", dict(eval_strategy="steps", eval_steps=1, eval_do_sample=False, eval_pass_at_k=[1])),
    ):
        t = GRPOTrainer(
            tiny_model("qwen2"),
            [digit_fraction, seen_completions],
            train_dataset=data,
            eval_dataset=data.select(range(4)) if extra else None,
            args=config(f"evalrng_{name}", max_steps=3, learning_rate=1e-2, max_completion_length=8, **extra),
        )
        KEEP.append(t)
        t.train()
        runs[name] = t
    keys = ("loss", "reward", "grad_norm", "rewards/digit_fraction/mean", "completions/mean_length")
    rows = {name: [{k: h[k] for k in keys if k in h} for h in training_rows(t)] for name, t in runs.items()}
    t = runs["greedy_eval"]
    draws = {}
    for mode, seed in (("greedy", 3), ("greedy", 4), ("sampled", 3), ("sampled", 4)):
        t.args.seed, t.args.eval_do_sample = seed, mode == "sampled"
        SEEN_COMPLETIONS.clear()
        metrics = t.evaluate()
        draws.setdefault(mode, []).append({"completions": list(SEEN_COMPLETIONS), "metrics": metrics})
    logged = []  # the evaluations after train() reach metrics.jsonl too (rank 0 writes it)
    if dist.is_main():
        with open(os.path.join(t.args.output_dir, "metrics.jsonl")) as fh:
            logged = [json.loads(line) for line in fh if "eval_reward" in line]
    return {
        "rows": rows,
        "draws": draws,
        "logged_evals": len(logged),
        "evals": [h for h in t.state.log_history if "eval_reward" in h][:3],
    }


# ------------------------------------------------------------------ 7. agent_rollout: agents that run their own loop
def agent_section():
    """An agent (async, its own loop through the OpenAI client) makes 3 calls an episode: the question with the
    tools, the tool's answer (it runs `add` itself), then one more user message. Odd rows rewrite their history
    after the tool call (one fresh message holding the result): the episode is split, each chain trained after its
    own prompt."""
    import urllib.error
    import urllib.request

    from dsgrpo import agent_reward, agent_rollout
    from dsgrpo.rollout.agents import assemble
    from dsgrpo.rollout.tools import tool_schemas

    schemas = tool_schemas(TOOLS)
    calls_made, streamed = [], []

    async def agent(client, row):
        messages = list(row["prompt"])
        reply = None
        for turn in range(3):
            if turn == 1 and row["style"] == "append":  # streamed, as verifiers' chat loop asks: same chain
                async with client.chat.completions.stream(
                    model="policy", messages=messages, tools=schemas, stream_options={"include_usage": True}
                ) as stream:
                    reply = await stream.get_final_completion()
                streamed.append(reply.usage.completion_tokens)
            else:
                reply = await client.chat.completions.create(
                    model="policy", messages=messages, tools=schemas, temperature=0.7
                )
            calls_made.append(row["style"])
            message = reply.choices[0].message
            if message.tool_calls:
                results = []
                for call in message.tool_calls:
                    arguments = json.loads(call.function.arguments)
                    try:
                        results.append((call, str(TOOLS[0](**arguments)) if call.function.name == "add" else "Error"))
                    except TypeError as exc:
                        results.append((call, f"Error: {exc}"))
                if row["style"] == "rewrite":  # the agent summarises: the tool turn is gone from its history
                    messages = [
                        {"role": "user", "content": f"{row['prompt'][0]['content']} The add tool says {results[0][1]}."}
                    ]
                    continue
                messages.append(message.model_dump(exclude_none=True))
                messages += [
                    {"role": "tool", "tool_call_id": c.id, "name": c.function.name, "content": text}
                    for c, text in results
                ]
            else:
                messages += [message.model_dump(exclude_none=True), {"role": "user", "content": "Say it again."}]
        return 1.0 if "5" in (reply.choices[0].message.content or "") else 0.1 * len(messages)

    rollout = agent_rollout(agent, max_concurrent=8)
    data = Dataset.from_list(
        [
            {
                "prompt": [{"role": "user", "content": "What is 2 plus 3?"}],
                "style": "append" if i % 2 == 0 else "rewrite",
            }
            for i in range(16)
        ]
    )
    trainer = GRPOTrainer(
        TOOL_MODEL,
        agent_reward,
        train_dataset=data,
        rollout_func=rollout,
        args=config("agents", max_completion_length=256, temperature=1.0),
    )
    KEEP.append(trainer)
    verdict = conformance(trainer)  # issue 66: the same checks on every path
    seen = spy_engine(trainer)
    restarts = spy_batches(trainer, lambda batch: [len(r) for r in batch.rollout.restarts or []])
    marked = spy_batches(  # how a split episode's completion reads in completions.jsonl, the report, text rewards
        trainer,
        lambda batch: [
            c[-1]["content"] if isinstance(c, list) else c
            for c, r in zip(batch.completions, batch.rollout.restarts or [])
            if r
        ],
    )
    start = time.time()
    trainer.train()
    seconds = time.time() - start
    episodes = rollout.last_episodes
    recorded, matched = calls_the_engine_sampled(episodes, seen)
    tok = trainer.tokenizer
    rows = []
    for e in episodes:
        seq = assemble(e.calls, [1])
        inserted = [t for t, m in zip(seq["completion_ids"], seq["env_mask"]) if m == 0]
        rows.append(
            {
                "calls": len(e.calls),
                "rewritten": seq["rewritten"],
                "turns": seq["turns"],
                "extends": [c.extends for c in e.calls],
                "inserted": tok.decode(inserted),
                "length": len(seq["completion_ids"]),
                "restarts": [at for at, _ in seq["restarts"]],
                "answers": [c.sampled.answer for c in e.calls],
                # what the agent's tools answered, as its later requests sent it back
                "tool_texts": sorted({m["content"] for c in e.calls for m in c.messages or [] if m["role"] == "tool"}),
            }
        )
    # bad requests, sent by hand on an open episode; the endpoint answers each and goes on serving
    endpoint = rollout.endpoint
    endpoint.episodes.open("probe", 256)

    def post(body, path="/chat/completions", headers=None, url=None):
        url = url or (endpoint.url + path if path else f"http://{endpoint.host}:{endpoint.port}/inference/v1/generate")
        req = urllib.request.Request(
            url,
            data=json.dumps(body).encode(),
            method="POST",
            headers={"Content-Type": "application/json", **(headers or {})},
        )
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    hello = [{"role": "user", "content": "What is 2 plus 3?"}]
    bad = {
        "unknown_model": post({"model": "gpt-9", "messages": hello, "episode_id": "probe"}),
        "malformed_messages": post({"messages": "hi", "episode_id": "probe"}),
        "bad_role": post({"messages": [{"role": "wizard", "content": "x"}], "episode_id": "probe"}),
        "too_many_tokens": post({"messages": [{"role": "user", "content": "7 " * 3000}], "episode_id": "probe"}),
        "unknown_episode": post({"messages": hello}, headers={"X-Episode-Id": "nobody"}),
        "stream_options": post({"messages": hello, "stream_options": {"include_usage": True}, "episode_id": "probe"}),
        "completions": post(
            {"prompt": "Write some numbers", "max_tokens": 4}, "/completions", {"X-Episode-Id": "probe"}
        ),
        "after": post({"messages": hello, "max_tokens": 4, "episode_id": "probe"}),
        # a tool message answering no tool call (OpenAI refuses it); max_tokens past the model's context (vLLM: 400)
        "orphan_tool": post(
            {
                "messages": hello + [{"role": "assistant", "content": "5"}, {"role": "tool", "content": "5"}],
                "episode_id": "probe",
            }
        ),
        "max_tokens_past_context": post({"messages": hello, "max_tokens": 10**6, "episode_id": "probe"}),
    }
    # vLLM's token-in/token-out route, as verifiers' TrainClient calls it: the episode in X-Session-ID, a second
    # call whose token ids continue the first's prompt + sampled ids extends its chain
    base = f"http://{endpoint.host}:{endpoint.port}"
    endpoint.episodes.open("tokens", 64)
    session = {"X-Session-ID": "tokens"}
    text = tok.apply_chat_template(hello, tokenize=False, add_generation_prompt=True)
    prompt = tok(text, add_special_tokens=False)["input_ids"]
    params = {"max_tokens": 6, "logprobs": 1, "skip_special_tokens": False, "stop_token_ids": [tok.eos_token_id]}
    first = post({"model": "policy", "token_ids": prompt, "sampling_params": params}, "", session)
    first_ids = first[1]["choices"][0]["token_ids"] if first[0] == 200 else []
    more = tok("\nok", add_special_tokens=False)["input_ids"]
    second = post({"model": "policy", "token_ids": prompt + first_ids + more, "sampling_params": params}, "", session)
    recorded_calls = endpoint.episodes.close("tokens").calls
    with urllib.request.urlopen(endpoint.url + "/models", timeout=60) as resp:
        models = json.loads(resp.read())
    tokens = {
        "first": first,
        "second": second,
        "recorded": [
            {"prompt": c.prompt_ids, "ids": c.sampled.ids, "logprobs": c.sampled.logprobs, "extends": c.extends}
            for c in recorded_calls
        ],
        "prompt": prompt,
        "abort": post({"request_ids": ["x"]}, "", None, base + "/inference/v1/abort_requests"),
        "models": models,
        "max_model_len": endpoint.max_model_len,
    }
    return {
        "conformance": verdict(),
        "history": training_rows(trainer),
        "seconds": seconds,
        "rows": rows,
        "bad": bad,
        "recorded": recorded,
        "matched_engine": matched,
        "trained_restarts": restarts,
        "packed": trainer.budget is not None,
        "calls_by_style": {s: calls_made.count(s) for s in ("append", "rewrite")},
        "streamed": streamed,
        "endpoint_host": endpoint.host,
        "tokens": tokens,
        "marked": marked,
    }


check("agents")(agent_section)


# ------------------------------------------------------------------ 8. agents' partial rollouts: episodes paused across
#                                                                    the sync
@check("agents_partial")
def _():
    """partial_rollout=True with agent_rollout: one prompt in three is answered by a slow agent, which waits for
    the next weight sync between its two calls (an agent waiting on I/O, made deterministic), so its group is still
    running when the round has its share: the endpoint pauses, the group is carried, and its second call, sent
    while the trainer trains, is generated after the sync with the new weights."""
    import asyncio
    import threading

    from dsgrpo import agent_reward, agent_rollout

    syncs, synced = [0], threading.Condition()

    def on_sync(needed):
        with synced:
            syncs[0] += 1
            synced.notify_all()

    def until_a_sync_after(seen):
        with synced:
            synced.wait_for(lambda: syncs[0] > seen, timeout=120)

    async def agent(client, row):
        messages, seen = list(row["prompt"]), syncs[0]
        for turn in range(2):
            reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=24)
            messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Again."}]
            if row["pace"] == "slow" and turn == 0:
                await asyncio.to_thread(until_a_sync_after, seen)
        return float("5" in (reply.choices[0].message.content or ""))

    data = Dataset.from_list(
        [
            {"prompt": [{"role": "user", "content": "What is 2 plus 3?"}], "pace": "slow" if i % 3 == 2 else "fast"}
            for i in range(24)
        ]
    )
    settings = dict(
        max_completion_length=96,
        partial_rollout=True,
        partial_rollout_adaptive=False,
        rollout_overprovision=2,
        max_staleness=2,
        shuffle_dataset=False,
        save_steps=2,
    )
    trainer = GRPOTrainer(
        TOOL_MODEL,
        agent_reward,
        train_dataset=data,
        rollout_func=agent_rollout(agent),
        args=config("agents_partial", max_steps=4, **settings),
    )
    KEEP.append(trainer)
    verdict = conformance(trainer)  # issue 66: the same checks on every path
    positions = []

    def trained_round(needed):  # the stream positions each round trained, then the slow agents go on
        positions.append(list(trainer.source.last_positions))
        on_sync(needed)

    after_each_sync(trainer, trained_round)
    trained = spy_batches(
        trainer,
        lambda batch: [
            {"pace": pace, "versions": sorted({v for v, m in zip(versions, mask) if m})}
            for pace, versions, mask in zip(
                batch.columns["pace"], batch.rollout.weight_versions, batch.rollout.tool_mask
            )
        ],
    )
    trainer.train()
    # a resume from step 2: the groups in flight then are run again from their start, and trained once
    saved = os.path.join(OUT, "agents_partial", "checkpoint-2")
    in_flight = json.load(open(os.path.join(saved, f"rollout_state_{dist.rank()}.json")))["agent_partial"]["in_flight"]
    resumed = GRPOTrainer(
        TOOL_MODEL,
        agent_reward,
        train_dataset=data,
        rollout_func=agent_rollout(agent),
        args=config("agents_partial_resumed", max_steps=4, resume_from_checkpoint=saved, **settings),
    )
    KEEP.append(resumed)
    resumed_positions = []

    def resumed_round(needed):
        resumed_positions.append(list(resumed.source.last_positions))
        on_sync(needed)

    after_each_sync(resumed, resumed_round)
    resumed.train()
    return {
        "conformance": verdict(),
        "history": training_rows(trainer),
        "trained": trained,
        "source": type(trainer.source).__name__,
        "positions": positions,
        "in_flight_at_2": in_flight,
        "resumed_positions": resumed_positions,
        "resumed_steps": resumed.state.global_step,
    }


@check("agents_async")
def _():
    """agent_rollout on AsyncGRPOTrainer: the rollout worker runs the agents (its chunk holds the engine, so a weight
    sync waits for the chunk's episodes), two calls an episode, the second built on the first's sampled ids."""
    from dsgrpo import agent_reward, agent_rollout

    async def agent(client, row):
        messages = list(row["prompt"])
        for _ in range(2):
            reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=24)
            messages += [
                reply.choices[0].message.model_dump(exclude_none=True),
                {"role": "user", "content": "Say it again."},
            ]
        return float(len(reply.choices[0].message.content or "")) / 100.0

    rollout = agent_rollout(agent, max_concurrent=8)
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": "What is 2 plus 3?"}]} for _ in range(24)])
    trainer = AsyncGRPOTrainer(
        TOOL_MODEL,
        agent_reward,
        train_dataset=data,
        rollout_func=rollout,
        args=config("agents_async", max_steps=3, max_completion_length=96, max_staleness=1, async_chunk_groups=1),
    )
    KEEP.append(trainer)
    verdict = conformance(trainer)  # issue 66: the same checks on every path
    seen = spy_engine(trainer)
    trainer.train()
    recorded, matched = calls_the_engine_sampled(rollout.last_episodes, seen)
    return {
        "conformance": verdict(),
        "history": training_rows(trainer),
        "recorded": recorded,
        "matched_engine": matched,
        "extends": [e.calls[-1].extends for e in rollout.last_episodes if len(e.calls) == 2],
        "versions": sorted(set(seen["versions"])),
    }


# ------------------------------------------------------------------ 10. a verifiers v1 environment in the env host's
#                                                                     own venv (issue 66)
@check("env_host")
def _():
    """verifiers' own Taskset, Task rewards, chat harness and TrainClient (its /inference/v1/generate calls) run in
    a host of the verifiers venv; the trainer trains the endpoint's record, each host branch held against it. In
    the third round rank 0 kills its host while episodes are in it: they fail (env/errors), the host starts again
    for the rest, and the run goes on."""
    import importlib.util
    import signal
    import threading

    from dsgrpo import agent_reward
    from dsgrpo.envhost import env_host_dataset, env_host_rollout

    modules = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "envhost_modules")
    rollout = env_host_rollout(
        "verifiers:dsgrpo_vf_digits",
        python=os.environ["DSGRPO_TEST_VERIFIERS_PYTHON"],
        paths=[modules],
        max_concurrent=4,
        timeout_s=300,
    )
    start = time.time()
    data = env_host_dataset(rollout)
    host_start_s = time.time() - start
    killed, original_play = [], rollout.play

    def kill_when_in_flight(calls_before):  # the host holds episodes once the engine answers this round's first call
        deadline = time.time() + 120
        while len(seen["versions"]) == calls_before and time.time() < deadline:
            time.sleep(0.005)
        os.kill(killed[0], signal.SIGKILL)

    async def play(base, row, episode_id):
        if dist.rank() == 0 and rollout.rounds == 2 and not killed:
            killed.append(rollout.env_host._process.pid)
            threading.Thread(target=kill_when_in_flight, args=(len(seen["versions"]),), daemon=True).start()
        return await original_play(base, row, episode_id)

    rollout.play = play
    trainer = GRPOTrainer(
        tiny_model("qwen2"),
        agent_reward,
        train_dataset=data,
        rollout_func=rollout,
        args=config("env_host", max_steps=3, max_completion_length=32, temperature=1.0),
    )
    KEEP.append(trainer)
    verdict = conformance(trainer)  # issue 66: the same checks on every path
    seen = spy_engine(trainer)
    start = time.time()
    trainer.train()
    seconds = time.time() - start
    recorded, matched = calls_the_engine_sampled(rollout.last_episodes, seen)
    host = rollout.env_host
    rollout.close()
    # partial rollouts (episodes run in the background loop across rounds), the async trainer, and verifiers' own
    # chat harness (`null`: a program per episode, where the default runs the same loop inside the host)
    other = {}
    for name, cls, settings, steps, harness in (
        (
            "partial",
            GRPOTrainer,
            dict(partial_rollout=True, partial_rollout_adaptive=False, rollout_overprovision=1),
            2,
            "dsgrpo_chat",
        ),
        ("async", AsyncGRPOTrainer, dict(max_staleness=1, async_chunk_groups=1), 2, "dsgrpo_chat"),
        ("null_harness", GRPOTrainer, dict(per_device_train_batch_size=4), 1, "null"),
    ):
        hosted = env_host_rollout(
            "verifiers:dsgrpo_vf_digits",
            python=rollout.host_options["python"],
            paths=[modules],
            env={"DSGRPO_VERIFIERS_HARNESS": harness},
        )
        run = cls(
            tiny_model("qwen2"),
            agent_reward,
            train_dataset=data,
            rollout_func=hosted,
            args=config(f"env_host_{name}", max_steps=steps, max_completion_length=32, temperature=1.0, **settings),
        )
        KEEP.append(run)
        run_verdict = conformance(run)
        start = time.time()
        run.train()
        other[name] = {
            "seconds": time.time() - start,
            "history": training_rows(run),
            "branch_checks": hosted.branch_checks,
            "source": type(run.source).__name__,
            "conformance": run_verdict(),
        }
        hosted.close()
    return {
        "conformance": verdict(),
        "other": other,
        "history": training_rows(trainer),
        "rows": len(data),
        "columns": sorted(data.column_names),
        "host_start_s": host_start_s,
        "seconds": seconds,
        "versions": host.versions,
        "trainer_has_verifiers": importlib.util.find_spec("verifiers") is not None,
        "branch_checks": rollout.branch_checks,
        "restarts": host.restarts,
        "killed": bool(killed),
        "recorded": recorded,
        "matched_engine": matched,
        "metrics": rollout.metrics,
        "generate_calls": sum(len(e.calls) for e in rollout.last_episodes),
    }


# ------------------------------------------------------------------ 11. reasoning-gym's tasks (issue 66): made here,
#                                                                     scored by the task's own scorer
@check("reasoning_gym")
def _():
    from dsgrpo.rewards.builtins import reasoning_gym_reward
    from dsgrpo.tasks import TASKS

    trainer = GRPOTrainer(
        tiny_model("qwen2"),
        reasoning_gym_reward,
        train_dataset=TASKS["reasoning_gym"]("letter_counting,gcd", size=32),
        args=config("reasoning_gym", max_steps=1, max_completion_length=16),
    )
    KEEP.append(trainer)
    verdict = conformance(trainer)
    scored = spy_batches(trainer, lambda batch: [batch.columns["reasoning_gym_entry"][0]])
    trainer.train()
    return {
        "history": training_rows(trainer),
        "conformance": verdict(),
        "entries": len(scored),
        "startup_seconds": trainer.startup_seconds,
    }


with open(os.path.join(OUT, f"result-{dist.rank()}.json"), "w") as fh:
    json.dump(results, fh)
dist.barrier("results written")

from dsgrpo.process_exit import leave  # noqa: E402

leave(0)  # out without the interpreter's teardown (dsgrpo/process_exit.py): 2.5 s a rank
