"""GRPOTrainer's and AsyncGRPOTrainer's `tools` and `rollout_func`, and TrainerControl flags, on 2 ranks with real
DeepSpeed ZeRO-3 and real in-process vLLM (fp32, CPU). The tool run needs a model that calls tools: the fixture
fine-tunes the tiny Qwen2 for a few seconds on one conversation per tool (plain torch, one process), then one launch
of tests/dist_scripts/api_checks.py records the numbers asserted below."""

import json
import os
import sys

import pytest

from launch import part, torchrun

pytestmark = pytest.mark.dist
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "dist_scripts"))

CALLS = {  # prompt → (tool, arguments, what the tool answers, the final answer)
    "What is 2 plus 3?": ("add", {"a": 2, "b": 3}, "5", "The answer is 5."),
    "Make it explode.": ("explode", {"x": 1}, "Error: ValueError: the tool broke on purpose", "Sorry."),
    "Wait for me.": ("stall", {"x": 1}, "Error: the tool did not answer within 0.5 s", "Sorry."),
}


def fine_tune_tool_caller(out: str, steps: int = 300) -> str:
    """The tiny Qwen2, taught to answer each prompt of CALLS with its tool call and, after the tool's answer,
    with a short reply. Loss on the assistant's part only."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import api_checks_tools as tools_module
    from dsgrpo.rollout.tools import tool_schemas
    from dsgrpo.testing import tiny_model

    base = tiny_model("qwen2")
    tok = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    schemas = tool_schemas(tools_module.TOOLS)
    examples = []
    for prompt, (name, arguments, answer, reply) in CALLS.items():
        user = [{"role": "user", "content": prompt}]
        messages = user + [
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"type": "function", "function": {"name": name, "arguments": arguments}}],
            },
            {"role": "tool", "content": answer},
            {"role": "assistant", "content": reply},
        ]
        head = tok.apply_chat_template(user, tools=schemas, tokenize=False, add_generation_prompt=True)
        full = tok.apply_chat_template(messages, tools=schemas, tokenize=False)
        ids = tok(full, add_special_tokens=False, return_tensors="pt")["input_ids"]
        labels = ids.clone()
        labels[:, : len(tok(head, add_special_tokens=False)["input_ids"])] = -100
        examples.append((ids, labels))
    torch.manual_seed(0)
    # 1e-3: at 3e-3 the loss oscillated back up near the end on an AVX-512 machine (0.02 → 0.2) and the model
    # wrote broken calls; at 1e-3 it falls smoothly to 0.01 within the 300 steps
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(steps):
        ids, labels = examples[step % len(examples)]
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


def start_fine_tune(folder):
    """fine_tune_tool_caller in a process of its own (tests/background.py starts it beside the unit tests)."""
    import background

    model = os.path.join(folder, "model")
    wait = background.command(
        [
            sys.executable,
            "-c",
            "import sys; sys.path.insert(0, sys.argv[1]); from test_api_dist "
            "import fine_tune_tool_caller; fine_tune_tool_caller(sys.argv[2])",
            os.path.dirname(os.path.abspath(__file__)),
            model,
        ],
        folder,
    )
    return lambda: (wait(), model)


def start_verifiers_env(folder):
    """`dsgrpo env-host build verifiers` in a process of its own (cached in ~/.cache/dsgrpo/envs after the first
    build: pip from the package registry, about a minute): the env host check's interpreter."""
    import background

    wait = background.command(
        [sys.executable, "-c", "import sys; from dsgrpo.cli import main; sys.exit(main(sys.argv[1:]))"]
        + ["env-host", "build", "verifiers"],
        folder,
        env={"OMP_NUM_THREADS": None, "MKL_NUM_THREADS": None},
    )

    def python():
        done = wait()
        assert done.returncode == 0, done.stderr[-4000:] + done.stdout[-2000:]
        return done.stdout.strip().splitlines()[-1].removeprefix("ready: ")

    return python


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    import background

    proc, model = background.result("tool_caller_model")
    assert proc.returncode == 0, proc.stderr[-4000:]
    verifiers_python = background.result("verifiers_env")
    out = tmp_path_factory.mktemp("api_checks")
    torchrun(
        "tests/dist_scripts/api_checks.py",
        str(out),
        model,
        timeout=900,
        env={"DSGRPO_TEST_VERIFIERS_PYTHON": verifiers_python},
    )
    per_rank = [json.load(open(out / f"result-{r}.json")) for r in range(2)]
    return per_rank


def check_tool_rows(rows):
    """Tool turns happened, their results (answers and failures) are inserted tokens with log-prob 0, and every
    micro-batch's loss mask leaves them out."""
    with_tools = [r for r in rows if r["n_inserted"]]
    assert len(with_tools) >= len(rows) // 2
    for row in with_tools:
        assert "<tool_response>" in row["inserted"] and row["inserted_logprobs_zero"], row
    assert all(r["mask_matches"] for r in rows if "mask_matches" in r)
    assert sum("mask_matches" in r for r in rows) >= 2


def check_answers_and_failures(rows):
    """Over both ranks' rows: some calls were answered (add: 5), some failed (explode raises, stall times out)."""
    with_tools = [r for r in rows if r["n_inserted"]]
    assert any("\n5\n</tool_response>" in r["inserted"] for r in with_tools)
    assert any("Error" in r["inserted"] for r in with_tools)


def test_tool_calls_run_and_their_results_are_masked_out_of_the_loss(results):
    for run in part(results, "tools"):
        assert run["prompt_shows_tools"]
        history = [h for h in run["history"] if "tools/call_frequency" in h]
        assert len(history) == 2
        assert all(h["tools/call_frequency"] >= 0.5 for h in history), history
        # explode raises and stall times out: failures are answered, never fatal
        assert all(0.2 <= h["tools/failure_frequency"] <= 0.9 for h in history), history
        print(f"tool run: {run['seconds']:.1f} s")  # a figure, not a gate (timing is bench/'s business)
        check_tool_rows(run["rows"])
        # the sampler's log-probs line up with the trained (sampled) tokens: fp32, same weights at step 1
        assert history[0]["sampling/sampling_logp_difference/max"] <= 1e-3, history[0]
    # the 30 s tool was abandoned at its 0.5 s limit: the model read the timeout, the run went on
    rows = [r for run in part(results, "tools") for r in run["rows"]]
    check_answers_and_failures(rows)
    assert any("timed out after 0.5 s" in r["inserted"] for r in rows)


def test_environments_act_per_rollout_with_their_methods_as_tools_and_own_a_reward(results):
    runs = part(results, "environments")
    for run in runs:
        assert run["reward_names"] == ["environment_reward", "Ledger"] and run["weights"] == [1.0, 1.0]
        history = [h for h in run["history"] if "tools/call_frequency" in h]
        assert len(history) == 2 and all(h["tools/call_frequency"] >= 0.5 for h in history), history
        assert all(0.2 <= h["tools/failure_frequency"] <= 0.9 for h in history), history
        # the environment's failures are named: explode raises (env/errors), stall outlives tool_timeout_s
        assert sum(h["env/errors"] + h["env/timeouts"] for h in history) > 0 and all(
            h["episode/turns"] >= 1 for h in history
        ), history
        check_tool_rows(run["rows"])
        # one instance per rollout, reset with its own row; the instance's state is what its tool turns did
        assert run["instances"] == run["distinct"] == run["batch_rows"] > 0 and run["env_prompts_match"]
        assert run["env_adds"] == run["answered_calls"]  # answered calls (some, over all rows: below)
        assert run["seen"] and all(same_length and distinct for same_length, distinct in run["seen"])
        assert history[0]["sampling/sampling_logp_difference/max"] <= 1e-3, history[0]
    # the environment's reward, logged under its class name, is the mean of the instances' get_reward()
    own = [x for run in runs for x in run["own_rewards"]]
    assert runs[0]["history"][-1]["rewards/Ledger/mean"] == pytest.approx(sum(own) / len(own), abs=1e-6)
    rows = [r for run in runs for r in run["rows"]]
    check_answers_and_failures(rows)


def test_agents_run_on_the_async_trainer(results):
    """agent_rollout on AsyncGRPOTrainer: its worker runs the agents; every recorded call is what the engine
    sampled, second calls continue their episode's chain, an on-policy round's trained log-probs match the
    sampler's, and the engine served more than one weight version over the run (the syncs happened between the
    worker's chunks)."""
    for run in part(results, "agents_async"):
        history = [h for h in run["history"] if "episode/turns" in h]
        assert len(history) == 3, run["history"]
        assert run["recorded"] > 0 and run["matched_engine"] == run["recorded"]
        assert run["extends"] and all(run["extends"]), run["extends"]
        # on-policy rounds: the trained log-probs are the sampler's; later ones may be one version behind
        fresh = [h for h in history if h["async/staleness/max"] == 0]
        assert fresh and all(h["sampling/sampling_logp_difference/max"] <= 1e-3 for h in fresh), history
        assert all(h["async/staleness/max"] <= 1 for h in history), history
        assert len(run["versions"]) >= 2, run["versions"]


def test_adapted_environments_play_through_the_trainer(results):
    """dsgrpo.adapters on 2 ranks, as one dict of environments: every rollout's game was dealt into its prompt (a
    TextArena game's rules, an OpenEnv environment's first observation) and each class's scores are its reward
    source (that textarena's reseeding never reaches the process-wide `random`: tests/test_adapters.py)."""
    dealt = {"openenv": 0, "textarena": 0}
    for run in part(results, "adapters"):
        assert sorted(run["reward_names"]) == ["GuessNumber", "TextArenaGame"]
        history = [h for h in run["history"] if "env/errors" in h]
        assert len(history) == 2 and all(h["env/errors"] == 0 for h in history), history
        assert set(run["kinds"]) <= {"GuessNumber", "TextArenaGame"} and all(0.0 <= r <= 1.0 for r in run["rewards"])
        for prompt in run["prompts"]:  # what the policy was prompted with: the row's prompt + its game's opening
            kind = (
                "openenv"
                if "Guess my number between 1 and 100" in prompt
                else "textarena"
                if "playing Guess The Number" in prompt or "playing Tower of Hanoi" in prompt
                else None
            )
            assert kind, prompt[-300:]
            dealt[kind] += 1
    assert dealt["openenv"] > 0 and dealt["textarena"] > 0, dealt


def test_rollout_func_feeds_its_extra_keys_to_the_rewards(results):
    for rank, run in enumerate(part(results, "rollout_func")):
        assert len(run["history"]) == 2
        assert len(run["tags"]) == 2 * 8 and all(t.startswith(f"rank{rank}-row") for t in run["tags"])
        assert run["history"][0]["sampling/sampling_logp_difference/max"] <= 1e-3


def test_rollout_func_bad_returns_name_the_key(results):
    errors = part(results, "rollout_func")[0]["errors"]
    assert "logprobs" in errors["missing"]
    assert "logprobs" in errors["short"] and "row" in errors["short"]
    assert errors["not_a_dict"] is not None and "dict" in errors["not_a_dict"]


def test_async_trainer_runs_tools_in_its_rollout_workers(results):
    for run in part(results, "async_tools"):
        history = run["history"]
        assert len(history) == 3
        for h in history:  # both families of metrics, every step
            assert h["tools/call_frequency"] >= 0.5 and 0.2 <= h["tools/failure_frequency"] <= 0.9, h
            assert 0 <= h["async/staleness/max"] <= 1 and "async/groups_stolen" in h, h
        check_tool_rows(run["rows"])
        # the background scorer got TRL's message lists, tool results included (when the tool turn fitted)
        assert run["rewards_rows"] > 0 and run["rewards_saw_lists"] == run["rewards_rows"]
        assert run["rewards_saw_tool_results"] > 0
        # step 1 trains groups sampled by the initial weights (fp32): the sampler's log-probs equal the trainer's
        assert history[0]["sampling/sampling_logp_difference/max"] <= 1e-3, history[0]
    check_answers_and_failures([r for run in part(results, "async_tools") for r in run["rows"]])


def test_async_trainer_acts_in_environments_in_its_rollout_workers(results):
    for run in part(results, "async_environments"):
        assert run["reward_names"] == ["environment_reward", "Ledger"]
        history = run["history"]
        assert len(history) == 2
        for h in history:
            assert h["tools/call_frequency"] >= 0.5 and "rewards/Ledger/mean" in h and "async/groups_stolen" in h, h
        check_tool_rows(run["rows"])
        # the worker's scorer got one live instance per completion
        assert run["seen"] and all(same_length and distinct for same_length, distinct in run["seen"])
        assert history[0]["sampling/sampling_logp_difference/max"] <= 1e-3, history[0]


def test_partial_rollouts_carry_episodes_over_the_sync_with_their_environments_alive(results):
    """partial_rollout=True with an environment, on GRPOTrainer and AsyncGRPOTrainer: rounds cut episodes mid-way
    (some right after a tool turn); they go on after the sync on the new weights with the same instance: every
    answered call is in its instance's state, rows mix versions, and the tool turns stay outside the loss."""
    crossed = 0
    for name in ("partial_environments", "async_partial_environments"):
        for run in part(results, name):
            assert run["reward_names"] == ["environment_reward", "Ledger"]
            history = run["history"]
            assert len(history) == 4 and all(h["tools/call_frequency"] >= 0.5 for h in history), history
            check_tool_rows(run["rows"])
            assert run["seen"] and all(same_length and distinct for same_length, distinct in run["seen"])
            scored_here = [b for b in run["batches"] if "env_adds" in b]  # (stolen groups left theirs behind)
            assert scored_here and all(
                b["instances"] == b["rows"] and b["env_adds"] == b["answered"] for b in scored_here
            ), run["batches"]
            assert sum(b["mixed"] for b in run["batches"]) > 0, run["batches"]
            crossed += sum(b["crossed"] for b in run["batches"])
            # step 1 trains tokens of the initial weights only: the sampler's log-probs are the trainer's
            assert history[0]["sampling/sampling_logp_difference/max"] <= 1e-3, history[0]
        if name == "partial_environments":
            assert sum(h["partial/completions_stopped"] for h in part(results, name)[0]["history"]) > 0
    assert crossed > 0  # episodes whose tool turn was answered in one round and whose reply was sampled in a later


def test_a_resume_starts_the_episodes_it_had_in_flight_again_from_reset(results):
    """A checkpoint cannot hold an environment: the resumed run says so once (rank 0) and samples those episodes
    again from reset, so no trained token predates the resumed weights (version 3) and every instance holds its
    episode's answered calls."""
    runs = part(results, "partial_environments_resumed")
    assert sum(r["saved_tokens"] for r in runs) > 0 and runs[0]["steps"] == 4
    total = sum(r["saved_groups"] for r in runs)
    assert len(runs[0]["said"]) == 1 and f"resumed {total} prompt group(s)" in runs[0]["said"][0], runs[0]["said"]
    assert runs[1]["said"] == []
    for run in runs:
        assert run["versions"] and min(run["versions"]) == 3, run["versions"]
        assert all(b["env_adds"] == b["answered"] for b in run["batches"] if "env_adds" in b), run["batches"]


def test_async_trainer_feeds_rollout_func_columns_to_the_rewards(results):
    ranks = part(results, "async_rollout_func")
    seen = {t for run in ranks for t in run["tags_seen"]}
    for rank, run in enumerate(ranks):
        assert len(run["history"]) == 3 and run["trained_rows"] == [8, 8, 8]
        for tags in run["trained_tags"]:
            assert len(tags) == 8 and all(t.startswith(("rank0-row", "rank1-row")) for t in tags), tags
            assert set(tags) <= seen  # every trained row's column reached a reward function (on either rank)
        assert all("async/staleness/mean" in h for h in run["history"])


def test_callbacks_steer_the_loop_through_trainer_control(results):
    ranks = part(results, "control")
    for run in ranks:
        assert run["steps"] == 4  # should_training_stop at step 4 (asked on rank 0 only) stopped both ranks
        assert run["logged"] == [3]  # logging_steps=100 (and no logging_first_step): step 3 because it was asked
        assert [step for step, _ in run["evaluated"]] == [3] and 0.0 <= run["evaluated"][0][1] <= 1.0
        # should_save at step 2 (asked on rank 1 only): both ranks wrote their part of checkpoint-2
        assert run["checkpoints"] == ["checkpoint-2"]
        assert run["saved"][0][0] == 2 and run["saved"][0][1].endswith("checkpoint-2")
        assert run["saved"][-1] == [4, None] and run["model_saved"]  # the end of training saves the model
    # step 3's training and evaluation rows, then the summary row at the end (transformers' train_runtime row)
    assert ranks[0]["metric_lines"] == [[3, False], [3, True], [4, False]]


def test_the_best_checkpoint_is_kept_recorded_through_a_resume_and_becomes_the_final_model(results):
    ranks = part(results, "best_model")
    for run in ranks:
        # evaluations after steps 1-4 score 0, 10, 0, -10 on step_reward: checkpoint-2 is the best
        assert run["best"].endswith("checkpoint-2") and run["best_step"] == 2
        assert 10.0 <= run["best_metric"] <= 10.0 + 1e-6
        assert run["checkpoints"] == ["checkpoint-2", "checkpoint-4"]  # save_total_limit=1 spares the best
        assert run["resumed_best"].endswith("checkpoint-2")  # the record came back with the resume
        assert run["resumed_checkpoints"] == ["checkpoint-2", "checkpoint-5"]
        # pass@k over the 4 samples of each eval prompt (correct: digit_fraction >= 0.5), logged with each evaluation
        assert [e["step"] for e in run["evals"]] == [1, 2, 3, 4]
        for e in run["evals"]:
            assert 0.0 <= e["eval_pass@1"] <= e["eval_pass@2"] <= e["eval_pass@4"] <= 1.0, e
            assert abs(e["eval_avg@4"] - e["eval_reward"]) <= 1e-6  # the mean reward of all samples
            # maj@1: a sample alone, right when correct and it states an answer (one without abstains: wrong)
            assert 0.0 <= e["eval_maj@1"] <= e["eval_pass@1"] + 1e-9 and 0.0 <= e["eval_maj@4"] <= 1.0, e
        assert any(e["eval_pass@4"] > e["eval_pass@1"] for e in run["evals"]) or all(
            e["eval_pass@1"] in (0.0, 1.0) for e in run["evals"]
        )  # more samples find more, unless all or none
    assert ranks[0]["final_vs_best"] <= 1e-6  # load_best_model_at_end: the final model is checkpoint-2's
    assert ranks[0]["final_vs_last"] > 1e-4  # which the three later steps had moved away from


def test_evaluation_never_moves_training_and_greedy_evaluation_is_seed_free(results):
    for run in part(results, "eval_rng_and_greedy"):
        assert (
            len(run["rows"]["no_eval"]) == 3 and run["rows"]["no_eval"][0]["loss"] == run["rows"]["no_eval"][0]["loss"]
        )
        assert run["rows"]["greedy_eval"] == run["rows"]["no_eval"]  # step for step, to the last bit
        assert [e["step"] for e in run["evals"]] == [1, 2, 3]
        for e in run["evals"]:  # one greedy completion per prompt: pass@1 and avg@1
            assert 0.0 <= e["eval_pass@1"] <= 1.0 and abs(e["eval_avg@1"] - e["eval_reward"]) <= 1e-6, e
        greedy, sampled = run["draws"]["greedy"], run["draws"]["sampled"]
        assert len(greedy[0]["completions"]) == 2  # this rank's half of 4 eval prompts, one completion each
        assert greedy[0]["completions"] == greedy[1]["completions"]  # another seed, the same greedy tokens
        assert greedy[0]["metrics"] == greedy[1]["metrics"]
        assert len(sampled[0]["completions"]) == 8  # 4 samples of each of its 2 prompts
        assert sampled[0]["completions"] != sampled[1]["completions"]  # sampling follows the seed
    assert results[0]["eval_rng_and_greedy"]["logged_evals"] == 3 + 4  # trainer.evaluate() after train() is logged


def test_a_resume_says_once_what_another_dataset_or_reward_list_changes_and_can_restart_the_data(results):
    for rank, r in enumerate(part(results, "resume_guards")):
        assert r["same"]["said"] == [] and r["same"]["offset"] == 0  # the same set: nothing to say
        said = r["changed"]["said"]
        if rank == 0:  # once, by rank 0
            assert len(said) == 1 and "the train dataset is another than the checkpoint's (16 rows" in said[0]
            assert "24 rows" in said[0] and "reset_data_position=True" in said[0] and "skipped" in said[0]
        else:
            assert said == []
        for key in ("reset", "alias"):  # ignore_data_skip is transformers' name for it
            assert r[key]["offset"] == 2
            if rank == 0:
                assert "starts from its first prompt at round 2" in r[key]["said"][0]
        if rank == 0:
            msg = r["rewards"]["said"][0]
            assert (
                "reward functions ['digit_fraction'] -> ['digit_fraction', 'digit_fraction_1']" in msg
                or "reward functions ['digit_fraction'] ->" in msg
            )
            assert "reward_weights None -> [1.0, 0.5]" in msg
    ranks = part(results, "resume_guards")

    def trained(key):
        return sorted({p for r in ranks for p in r[key]["prompts"]})

    # without the reset the new set's round-2 prompts train (rows 8..11 of 'Spell word'); with it, its first four
    assert trained("changed") == sorted(f"Spell word {i}:" for i in range(8, 12))
    assert trained("reset") == trained("alias") == sorted(f"Spell word {i}:" for i in range(0, 4))
    assert trained("same") == sorted(f"Count {i}:" for i in range(8, 12))


def test_agents_run_their_own_loop_through_the_openai_endpoint(results):
    """agent_rollout: every call an agent made through the OpenAI client is recorded as the engine sampled it
    (ids and log-probs), an episode that appends to its conversation trains as one sequence (tool results masked),
    one that rewrote its history is split where it did (each chain trained after its own prompt) and counted, a
    streamed call continues its chain as a whole one does, and bad requests get OpenAI's errors while the endpoint
    keeps serving."""
    runs = part(results, "agents")
    rows = [r for run in runs for r in run["rows"]]
    for run in runs:
        assert run["endpoint_host"] == "127.0.0.1"  # loopback unless a token is given
        history = [h for h in run["history"] if "episode/turns" in h]
        assert len(history) == 2, run["history"]
        assert run["recorded"] >= 2 * 8 and run["matched_engine"] == run["recorded"]
        assert all(h["sampling/sampling_logp_difference/max"] <= 1e-3 for h in history), history
        assert all(0 < h["episode/turns"] <= 3 for h in history), history  # an agent past its budget: an error
        print(f"agent run: {run['seconds']:.1f} s, {run['recorded']} calls on this rank")  # a figure, not a gate
        bad = run["bad"]
        assert bad["unknown_model"][0] == 404 and bad["unknown_model"][1]["error"]["code"] == "model_not_found"
        for name in ("malformed_messages", "bad_role"):
            assert bad[name][0] == 400 and bad[name][1]["error"]["param"] == "messages", bad[name]
            assert bad[name][1]["error"]["type"] == "invalid_request_error"
        assert (
            bad["too_many_tokens"][0] == 400 and bad["too_many_tokens"][1]["error"]["code"] == "context_length_exceeded"
        )
        assert bad["unknown_episode"][0] == 404 and bad["unknown_episode"][1]["error"]["code"] == "unknown_episode"
        assert bad["stream_options"][0] == 400 and bad["stream_options"][1]["error"]["param"] == "stream_options"
        # the append rows' second calls were streamed (stream=true, usage chunk) and their chains still extend
        assert len(run["streamed"]) >= 4 and all(n > 0 for n in run["streamed"]), run["streamed"]
        assert bad["completions"][0] == 200 and bad["completions"][1]["object"] == "text_completion"
        assert bad["after"][0] == 200 and bad["after"][1]["choices"][0]["message"]["role"] == "assistant"
        assert (
            bad["orphan_tool"][0] == 400
            and "must be a response to a preceding" in bad["orphan_tool"][1]["error"]["message"]
        )
        past = bad["max_tokens_past_context"]
        assert past[0] == 400 and past[1]["error"]["code"] == "context_length_exceeded", past
        assert past[1]["error"]["param"] == "max_tokens" and "maximum context length" in past[1]["error"]["message"]
        # the token-in/token-out route (verifiers' TrainClient): ids and log-probs exactly as recorded for training
        t = run["tokens"]
        assert t["first"][0] == 200 and t["second"][0] == 200, (t["first"], t["second"])
        assert t["models"]["data"][0]["max_model_len"] == t["max_model_len"] and t["max_model_len"] > 0
        assert t["abort"][0] == 200
        first, second = t["first"][1], t["second"][1]
        assert first["prompt_token_ids"] == t["prompt"] and first["output_mode"] == "tokens"
        for answer, rec in zip((first, second), t["recorded"]):
            choice = answer["choices"][0]
            assert choice["token_ids"] == rec["ids"] and 0 < len(rec["ids"]) <= 6
            content = choice["logprobs"]["content"]
            assert [e["token"] for e in content] == [f"token_id:{i}" for i in rec["ids"]]  # as renderers check it
            assert [e["token_id"] for e in content] == rec["ids"] and [e["logprob"] for e in content] == rec["logprobs"]
            assert choice["weight_versions"][0]["start"] == 0 and choice["weight_versions"][-1]["end"] == len(
                rec["ids"]
            )
        assert [r["extends"] for r in t["recorded"]] == [False, True]  # the second continues the first's chain
        assert t["recorded"][1]["prompt"][: len(t["prompt"])] == t["prompt"]
        # a split episode's chains read apart wherever its completion is text
        assert run["marked"] and all("a new chain of calls starts here" in c for c in run["marked"]), run["marked"]
    assert rows and all(2 <= r["calls"] <= 3 for r in rows) and sum(r["calls"] == 3 for r in rows) > len(rows) // 2
    appended = [r for r in rows if not r["rewritten"]]
    rewritten = [r for r in rows if r["rewritten"]]
    assert appended and rewritten
    for r in appended:  # one chain: the 2nd and 3rd prompts are built on what was sampled
        assert r["extends"][0] is False and all(r["extends"][1:]) and r["turns"] == r["calls"], r
        assert ("<tool_response>" in r["inserted"]) == bool(r["answers"][0].get("tool_calls")), r
        text_turns = [a for a in r["answers"][:2] if not a.get("tool_calls")]
        assert ("Say it again." in r["inserted"]) == bool(text_turns[: r["calls"] - 1]) and r["length"] <= 256
        for text in r["tool_texts"]:  # each tool answer sits in the chain as the agent sent it, masked
            assert f"<tool_response>\n{text}\n</tool_response>" in r["inserted"], r
    # at least one appended episode called a tool (a first call is one about 3 times in 4: all 7 or 8 of a round's
    # appended episodes answering in text is about 1 in 16,000); whether the tiny model's arguments make add() answer
    # 5 is the model's luck, not the endpoint's (one round's 7 appended episodes had none: this test failed on it)
    assert any(r["tool_texts"] for r in appended), appended
    for r in rewritten:  # the agent replaced its history after the tool call: split there, every call trains
        starts = [i for i, e in enumerate(r["extends"]) if not e]
        assert len(starts) >= 2 and len(r["restarts"]) == len(starts) - 1 and r["turns"] == r["calls"], r
        assert "<tool_response>" not in r["inserted"] and r["length"] <= 256  # one budget over its chains
    for run in runs:  # the split episodes trained as pieces, each after its own prompt: the trained log-probs
        # above equal the sampler's only if every piece saw its own context (one context would move them far)
        assert run["packed"] and sum(n > 0 for n in run["trained_restarts"]) >= 2, run["trained_restarts"]
    shares = [h["episode/rewritten"] for run in runs for h in run["history"] if "episode/rewritten" in h]
    assert shares and all(0 <= s <= 1 for s in shares) and sum(shares) > 0


def test_agents_partial_rollouts_pause_an_episode_across_the_weight_sync(results):
    """partial_rollout=True with agent_rollout (rollout/agent_partial.py): a slow agent's group is carried over the
    sync; its second call waits while the trainer trains and is generated with the new weights, so the trained
    episode holds tokens of two versions; fast groups stay on one."""
    for run in part(results, "agents_partial"):
        assert run["source"] == "AgentPartialSource"
        history = [h for h in run["history"] if "partial/groups_trained_carried" in h]
        assert len(history) == 4, run["history"]
        assert history[0]["sampling/sampling_logp_difference/max"] <= 1e-3  # round 1: every token on-policy
        assert sum(h["partial/groups_trained_carried"] for h in history) > 0, history
        # every token labelled with the current version is the current policy's, the paused calls' included
        assert all(h["partial/sampler_gap/age0"] <= 1e-3 for h in history), history
        trained = run["trained"]
        assert len(trained) == 4 * 8  # 2 groups of 4 episodes a round on each rank
        assert all(len(r["versions"]) == 1 for r in trained if r["pace"] == "fast"), trained
        slow = [r for r in trained if r["pace"] == "slow"]  # their calls on each side of a sync
        assert slow and all(len(r["versions"]) == 2 and r["versions"][0] < r["versions"][1] for r in slow), trained
        # resumed from step 2: the groups in flight then (an agent's loop is not in a checkpoint) run again from
        # their start and train once; nothing trained before the checkpoint trains again
        before = {p for rnd in run["positions"][:2] for p in rnd}
        after = [p for rnd in run["resumed_positions"] for p in rnd]
        assert run["resumed_steps"] == 4 and run["in_flight_at_2"], run
        assert set(run["in_flight_at_2"]) <= set(after) and not before & set(after), run
        assert len(after) == len(set(after)), run


def test_a_verifiers_environment_trains_through_the_env_host_in_its_own_venv(results):
    """Issue 66: a verifiers v1 taskset of our own (tests/envhost_modules/dsgrpo_vf_digits: a local Taskset, the
    plain chat harness, a reward on the answer) runs in the env host's verifiers venv: verifiers' TrainClient
    renders each prompt and calls the rank's /inference/v1/generate; the trainer trains the endpoint's record, and
    every host branch equals it token for token (none refused). Rank 0 kills its host in the third round: the
    episodes it held fail (env/errors), the host starts again for the rest, and the run completes its steps."""
    runs = part(results, "env_host")
    for rank, run in enumerate(runs):
        assert run["versions"]["verifiers"] == "0.4.0" and not run["trainer_has_verifiers"], run["versions"]
        assert run["rows"] == 16 and run["columns"] == ["prompt", "task_index"]  # the Taskset's own rows
        history = run["history"]
        assert [h["step"] for h in history] == [1, 2, 3], history
        assert all(h["env/errors"] == 0 for h in history[:2]), history
        assert 0 < history[2]["env/errors"] < 1, history  # some of round 3's episodes were lost, not all
        assert run["branch_checks"]["refused"] == 0 and run["branch_checks"]["matched"] >= 16, run["branch_checks"]
        assert run["recorded"] == run["matched_engine"] and run["generate_calls"] >= 4, run
        assert run["restarts"] == (1 if rank == 0 else 0) and run["killed"] == (rank == 0), run
        # the reward is verifiers' (digits in the reply), it varies within groups, so the policy moves
        assert all(0 <= h["reward"] <= 1 for h in history) and any(h["grad_norm"] > 0 for h in history), history
        # verifiers' own metric (the taskset's @vf.metric reply_chars) reaches the log, a mean over the episodes
        assert all(h["env_metrics/reply_chars"] > 0 for h in history) and run["metrics"]["reply_chars"] > 0, history
        print(f"env host rank {rank}: {run['seconds']:.1f} s for 3 rounds, host up in {run['host_start_s']:.1f} s")
        # the same environment with partial rollouts (episodes in the background loop), the async trainer, and
        # verifiers' own chat harness (`null`, a program per episode) in place of the host's loop: 1 step of 4
        assert sorted(run["other"]) == ["async", "null_harness", "partial"], run["other"].keys()
        for name, other in run["other"].items():
            steps, episodes = ([1], 4) if name == "null_harness" else ([1, 2], 8)
            assert [h["step"] for h in other["history"]] == steps, (name, other)
            assert all(h["env/errors"] == 0 and 0 <= h["reward"] <= 1 for h in other["history"]), (name, other)
            assert other["branch_checks"]["refused"] == 0, (name, other)
            assert other["branch_checks"]["matched"] >= episodes, (name, other)
        assert run["other"]["partial"]["source"] == "AgentPartialSource"
        null_s = run["other"]["null_harness"]["seconds"]
        print(f"env host rank {rank}: verifiers' null harness, 4 episodes in {null_s:.1f} s")


# issue 66's conformance suite: the same checks on every environment path's trained rows (recorder.conformance)
CONFORMANCE_PATHS = {  # check name (and sub-run) -> (the path, whether its episodes insert environment tokens)
    ("tools", None): ("tools= (TRL's tools argument)", True),
    ("environments", None): ("environment_factory (TRL)", True),
    ("adapters", None): ("TextArena and OpenEnv adapters", False),
    ("agents", None): ("agent_rollout", True),
    ("agents_async", None): ("agent_rollout, AsyncGRPOTrainer", True),
    ("env_host", None): ("env host, verifiers v1", False),
    ("env_host", "partial"): ("env host, verifiers v1, partial rollouts", False),
    ("env_host", "async"): ("env host, verifiers v1, AsyncGRPOTrainer", False),
    ("env_host", "null_harness"): ("env host, verifiers v1, verifiers' own chat harness (null)", False),
    ("reasoning_gym", None): ("task:reasoning_gym", False),
}
# AsyncGRPOTrainer moves groups between ranks so each trains the same number (pool.plan_batch): a rank may train
# runs another rank's engine sampled, so the verdict holds rows against every rank's engine record and counts
# those (sampled_runs_from_other_ranks). Held against this rank's record alone, agents_async once showed 40 of 48.


def test_every_environment_path_trains_the_engines_own_samples_and_masks_the_environments_tokens(results):
    """For every path: every sampled run of every trained row is an engine's own output for its context (the
    prompt, then the row's tokens before it) with the engine's log-probs; every token the environment inserted has
    log-prob 0 and leaves the loss; rows trained on both ranks. (Errors in the metrics: env_host's killed host,
    tools' failing calls; resume: agents_partial, partial_environments_resumed.)"""
    table = []
    for (name, sub), (path, inserts) in CONFORMANCE_PATHS.items():
        for rank, run in enumerate(part(results, name)):
            verdict = (run["other"][sub] if sub else run)["conformance"]
            table.append((path, rank, verdict))
            assert verdict["rows"] > 0 and verdict["sampled_runs"] >= verdict["chains"] > 0, (path, verdict)
            assert verdict["ranks_without_record"] == [], (path, verdict)
            assert verdict["sampled_runs_from_engine"] == verdict["sampled_runs"], (path, verdict["unmatched"])
            assert verdict["environment_tokens_logprob_0"] == verdict["environment_tokens"], (path, verdict)
            assert (verdict["environment_tokens"] > 0) == inserts, (path, verdict)
    print("\npath | rank | rows | sampled runs from an engine (the other rank's) | environment tokens (log-prob 0)")
    for path, rank, v in table:
        print(
            f"{path} | {rank} | {v['rows']} | {v['sampled_runs_from_engine']}/{v['sampled_runs']} "
            f"({v['sampled_runs_from_other_ranks']}) | "
            f"{v['environment_tokens_logprob_0']}/{v['environment_tokens']}"
        )


def test_reasoning_gym_rows_train_and_the_start_up_is_timed_part_by_part(results):
    """task:reasoning_gym's rows train on both ranks, scored by reasoning-gym; the trainer's start-up breakdown
    (issue 69) names its parts, each a share of the total (this is not the launch's first trainer: it counts from
    its own construction)."""
    for run in part(results, "reasoning_gym"):
        assert run["entries"] >= 1 and [h["step"] for h in run["history"]] == [1]
        assert all(0 <= h["reward"] <= 1 for h in run["history"])
        seconds = run["startup_seconds"]
        for name in ("process group", "policy load", "DeepSpeed (policy)", "generation engine"):
            assert 0 <= seconds[name] < seconds["total"], (name, seconds)
        assert abs(sum(v for k, v in seconds.items() if k != "total") - seconds["total"]) < 1e-3, seconds
        assert seconds["generation engine"] > 0.1, seconds  # vLLM's engine is built here
