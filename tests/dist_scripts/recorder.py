"""What the 2-rank check scripts share: a decorator that records each check's numbers (or its traceback, so the
other checks still run and the pytest side names the one that failed), the settings every check's GRPOConfig
starts from, the ZeRO-3 config that really shards tiny models (persistence threshold 0), the digit-fraction reward
most of them train on, and log-probs of one fixed token sequence as the policy and as vLLM see them (how a weight
sync is checked)."""

import os
import pickle
import time
import traceback

import torch

SHARDED_ZERO3 = {
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "torch_adam": True}},
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
}


# Small steps that log every step, never save unless asked and keep activations: what every check wants
CHECK_SETTINGS = dict(
    per_device_train_batch_size=8,
    num_generations=4,
    lr_scheduler_type="constant",
    logging_steps=1,
    gradient_checkpointing=False,
    save_steps=10**6,
)


def check_config(out: str, **script_settings):
    """A script's `config(name, **overrides)`: a GRPOConfig writing to out/name, from CHECK_SETTINGS, then the
    script's own settings, then the check's overrides."""
    from dsgrpo import GRPOConfig

    def config(name, **overrides):
        return GRPOConfig(**{**CHECK_SETTINGS, "output_dir": os.path.join(out, name), **script_settings, **overrides})

    return config


def recorder(results: dict, only=None):
    """`@check(name)` runs the function now and stores its return value in results[name]; with `only`, checks
    whose name is not in it are skipped."""

    def check(name):
        def wrap(fn):
            if only and name not in only:
                return fn
            try:
                results[name] = fn()
            except Exception:
                results[name] = {"error": traceback.format_exc()}
            return fn

        return wrap

    return check


def digit_fraction(prompts, completions, **kwargs):
    """The share of digits in each completion: a reward tiny random models learn within a few steps."""
    return [sum(ch.isdigit() for ch in c) / max(1, len(c)) for c in completions]


FIXED = [1, 5, 9, 12, 30, 31, 32, 33, 34, 35]  # a token sequence whose log-probs every side computes


def policy_logps(model):
    """log-probs of FIXED[1:] under a model or DeepSpeed engine (collective under ZeRO-3)."""
    from dsgrpo.engines import completion_logprobs

    ids = torch.tensor([FIXED])
    with torch.no_grad():
        lp, _ = completion_logprobs(model, ids, torch.ones_like(ids), len(FIXED) - 1)
    return lp[0].tolist()


def vllm_logps(trainer):
    """log-probs of FIXED[1:] under the trainer's colocated vLLM engine."""
    from vllm import SamplingParams

    out = trainer.generator.llm.generate(
        [{"prompt_token_ids": FIXED}], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False
    )[0]
    return [step[tok].logprob for step, tok in zip(out.prompt_logprobs[1:], FIXED[1:])]


def training_rows(trainer) -> list:
    """The training rounds of a trainer's log_history (evaluation rows and transformers' final summary row, with
    train_runtime and train_loss, left out)."""
    return [h for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]


def after_each_sync(trainer, fn) -> None:
    """Call fn(needed) right after every weight sync of the trainer's rollout source."""
    original = trainer.source.sync_weights

    def sync(policy_module, round_index, needed=True):
        original(policy_module, round_index, needed)
        fn(needed)

    trainer.source.sync_weights = sync


def rollout_worker(trainer):
    """The trainer's background rollout worker (AsyncGRPOTrainer), on a training or a generating rank."""
    owner = trainer.source if trainer.source is not None else trainer.generating_rank
    return owner.worker


def watch_split_versions(trainer) -> dict:
    """Split placement: {weights version: log-probs of FIXED}, from the policy right after each broadcast on a
    training rank, from vLLM once it has loaded them on a generating rank (version 0: before training)."""
    by_version = {}
    if trainer.trains:

        def sync(needed):
            if needed:
                by_version[trainer.state.generation_round + 1] = policy_logps(trainer.policy.engine)

        after_each_sync(trainer, sync)
        by_version[0] = policy_logps(trainer.policy.engine)
    else:
        rank = trainer.generating_rank
        original_receive = rank.receive_weights

        def receive(version):
            original_receive(version)
            with rank.worker.paused():
                by_version[version] = vllm_logps(trainer)

        rank.receive_weights = receive
        by_version[0] = vllm_logps(trainer)
    return by_version


def train_recording(trainer) -> dict:
    """Train `trainer`, recording the old-policy / reference log-probs it computes (every token, flat) and its
    micro-steps; returns them with the full parameters and the logged loss, grad_norm and entropy per step."""
    from dsgrpo.engines.weights import named_full_parameters

    seen = {"logps": [], "micro_steps": 0}
    logprobs, step = trainer._logprobs, trainer.training_step

    def recording(engine, batch, truncation=None):
        out = logprobs(engine, batch, truncation)
        seen["logps"].append(torch.cat([x.reshape(-1) for x in out]).tolist())
        return out

    def counting(model, inputs, num_items_in_batch=None):
        seen["micro_steps"] += 1
        return step(model, inputs)

    trainer._logprobs, trainer.training_step = recording, counting
    trainer.train()
    rows = [h for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]
    return {
        "params": {n: p.tolist() for n, p in named_full_parameters(trainer.policy.module, 1 << 30)},
        "loss": [h["loss"] for h in rows],
        "grad_norm": [h["grad_norm"] for h in rows],
        "entropy": [h.get("entropy") for h in rows],
        "logps": seen["logps"],
        "micro_steps": seen["micro_steps"],
        "steps": trainer.state.global_step,
    }


def spy_batches(trainer, read=None) -> list:
    """Every batch the trainer scores, caught as it is scored (the next round may reset the environments its rows
    point to): the batches themselves, or the items `read(batch)` makes of each."""
    seen, score = [], trainer._score

    def spy(batch, group):
        seen.extend([batch] if read is None else read(batch))
        return score(batch, group)

    trainer._score = spy
    return seen


def spy_engine(trainer) -> dict:
    """Records the engine's own outputs, row by row (prompt ids -> [(completion ids, log-probs)]) and the weight
    version of each engine call, to compare an endpoint's recorded calls with."""
    seen = {"rows": {}, "versions": []}
    original = trainer.generator.generate

    def engine(prompt_ids, counts, sampling, seeds=None):
        out = original(prompt_ids, counts, sampling, seeds=seeds)
        for p, c, lp in zip(out.prompt_ids, out.completion_ids, out.sampler_logprobs):
            seen["rows"].setdefault(tuple(p), []).append((c, lp))
        seen["versions"].append(trainer.generator.weight_version)
        return out

    trainer.generator.generate = engine
    return seen


def calls_the_engine_sampled(episodes, seen) -> tuple:
    """(recorded choices, how many of them start a row the engine sampled for that prompt: a call cut to its own
    room inside a batched engine call keeps a prefix)."""
    recorded = [(c.prompt_ids, ch.ids, ch.logprobs) for e in episodes for c in e.calls for ch in c.choices]
    matched = sum(
        any(ec[: len(ids)] == ids and elp[: len(lps)] == lps for ec, elp in seen["rows"].get(tuple(p), []))
        for p, ids, lps in recorded
    )
    return len(recorded), matched


def every_ranks_engine(trainer, rows: dict, wait_s: float = 120.0) -> tuple:
    """This rank's engine record merged with every other rank's (the async trainer moves groups between ranks so
    each trains the same number: a row may have been sampled by another rank's engine). Exchanged through files
    beside the run (named by the run's output_dir, which every rank shares), not a collective, so a rank whose check
    failed before asking leaves the others waiting `wait_s` at most. Returns (the merged record, the ranks whose
    record never came)."""
    import torch.distributed as td

    if not (td.is_available() and td.is_initialized()) or td.get_world_size() == 1:
        return rows, []
    me, world = td.get_rank(), td.get_world_size()
    run = os.path.abspath(trainer.args.output_dir)
    folder, n = os.path.join(os.path.dirname(run), "engine-records"), os.path.basename(run)
    os.makedirs(folder, exist_ok=True)
    mine = os.path.join(folder, f"{n}-{me}.pkl")
    with open(mine + ".tmp", "wb") as f:
        pickle.dump(rows, f)
    os.replace(mine + ".tmp", mine)
    merged = {k: list(v) for k, v in rows.items()}
    missing = []
    for other in range(world):
        if other == me:
            continue
        path, deadline = os.path.join(folder, f"{n}-{other}.pkl"), time.monotonic() + wait_s
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.2)
        if not os.path.exists(path):
            missing.append(other)
            continue
        with open(path, "rb") as f:
            for k, v in pickle.load(f).items():
                merged.setdefault(k, []).extend(v)
    return merged, missing


def conformance(trainer):
    """Issue 66's conformance checks, the same for every environment path: spies on the engine and on the batches the
    trainer scores; the function returned gives, over every row that trained, how many sampled runs (maximal spans
    of sampled tokens) are an engine's own output for their context (the prompt, the row's tokens before them) with
    the engine's log-probs; how many environment tokens (inserted: tool results, user turns) there were and whether
    every one has log-prob 0 and leaves the loss; and the rewards the rows got (None kept). Rows that an agent split
    into chains are checked chain by chain, each after its own prompt. Every rank's engine counts (the async
    trainer trains groups another rank sampled); `sampled_runs_from_other_ranks` says how many runs only another
    rank's engine gave."""
    seen = spy_engine(trainer)
    rows = spy_batches(
        trainer,
        lambda batch: [
            {
                "prompt": list(r.prompt_ids[i]),
                "ids": list(r.completion_ids[i]),
                "mask": list(r.tool_mask[i]) if r.tool_mask is not None else [1] * len(r.completion_ids[i]),
                "logprobs": [float(x) for x in r.sampler_logprobs[i]],
                "restarts": [[at, list(p)] for at, p in (r.restarts[i] if r.restarts else [])],
            }
            for r in [batch.rollout]
            for i in range(len(r.completion_ids))
        ],
    )

    def matches(record, context, ids, logprobs):
        """The sampled run `ids` as engine outputs for its context, one after another (an agent's next call may
        continue the last with nothing in between): the number of tokens the engine's outputs account for."""
        done = 0
        while done < len(ids):
            best = 0
            for out, lps in record.get(tuple(context + ids[:done]), []):
                n = 0
                while (
                    n < len(out)
                    and done + n < len(ids)
                    and out[n] == ids[done + n]
                    and abs(lps[n] - logprobs[done + n]) <= 1e-5
                ):
                    n += 1
                best = max(best, n)
            if best == 0:
                return done
            done += best
        return done

    def verdict() -> dict:
        everyone, missing = every_ranks_engine(trainer, seen["rows"])
        runs = matched = elsewhere = inserted = inserted_ok = chains = 0
        unmatched = []  # the first few runs the engine did not give, to say why a check failed
        for row in rows:
            pieces, starts = [], [0] + [at for at, _ in row["restarts"]] + [len(row["ids"])]
            prompts = [row["prompt"]] + [p for _, p in row["restarts"]]
            for k in range(len(starts) - 1):
                pieces.append((prompts[k], starts[k], starts[k + 1]))
            chains += len(pieces)
            for prompt, begin, end in pieces:
                i = begin
                while i < end:
                    j = i
                    while j < end and row["mask"][j] == row["mask"][i]:
                        j += 1
                    if row["mask"][i]:
                        runs += 1
                        context = prompt + row["ids"][begin:i]
                        found = matches(everyone, context, row["ids"][i:j], row["logprobs"][i:j])
                        matched += found == j - i
                        elsewhere += (
                            found == j - i
                            and matches(seen["rows"], context, row["ids"][i:j], row["logprobs"][i:j]) != j - i
                        )
                        if found != j - i and len(unmatched) < 3:
                            outputs = everyone.get(tuple(context + row["ids"][i : i + found]), [])
                            unmatched.append(
                                {
                                    "context_tail": context[-8:],
                                    "at": found,
                                    "run": row["ids"][i:j][:12],
                                    "logprobs": row["logprobs"][i:j][:4],
                                    "engine_outputs": [[o[:12], lp[:4]] for o, lp in outputs[:3]],
                                }
                            )
                    else:
                        inserted += j - i
                        inserted_ok += sum(lp == 0.0 for lp in row["logprobs"][i:j])
                    i = j
        return {
            "rows": len(rows),
            "chains": chains,
            "sampled_runs": runs,
            "sampled_runs_from_engine": matched,
            "sampled_runs_from_other_ranks": elsewhere,
            "ranks_without_record": missing,
            "environment_tokens": inserted,
            "environment_tokens_logprob_0": inserted_ok,
            "unmatched": unmatched,
        }

    return verdict
