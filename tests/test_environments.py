"""Environments (dsgrpo/rollout/environments.py, TRL's `environment_factory`): one instance per rollout, reset with its
row, its methods as tools across turns, its reward, and the errors a user gets before any compute. Generation is a
scripted generator standing in for vLLM (a unit test); TRL's own environment tests run the real trainer
(../shared/trl_tests, TRL_TESTS_FILE=test_grpo_environments.py)."""

import json

import pytest
from datasets import Dataset

from dsgrpo.data import PromptSource
from dsgrpo.rollout.base import Rollout, SamplingConfig
from dsgrpo.rollout.environments import EnvironmentSampler, Environments, environment_prompts
from dsgrpo.rollout.tools import COUNTS, ToolStats, tool_result_ids


class GuessEnv:
    """Guess a number over several turns; the environment keeps the guesses."""

    def reset(self, target, **row):
        self.target, self.guesses, self.row = target, [], dict(row, target=target)
        return " Guess a number from 1 to 9."

    def guess(self, number: int) -> str:
        """Guess the number.

        Args:
            number: Your guess.
        """
        self.guesses.append(number)
        return "correct" if number == self.target else "higher" if number < self.target else "lower"

    def broken(self, x: int) -> str:
        """A tool whose environment fails.

        Args:
            x: Anything.
        """
        raise RuntimeError("the environment fell over")

    def get_reward(self) -> float:
        return 1.0 if self.target in self.guesses else 0.0


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from dsgrpo.testing import tiny_tokenizer

    return AutoTokenizer.from_pretrained(tiny_tokenizer())


def call_text(name, arguments):
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


class ScriptedGenerator:
    """Stands in for vLLM: a row's next turn is `script(prompt text, turns answered so far)` plus eos; records what
    it sampled so the trained ids can be compared with it."""

    def __init__(self, tok, script):
        self.tok, self.script, self.sampled, self.calls = tok, script, [], []

    def generate(self, prompt_ids, counts, sampling, seeds=None):
        assert counts == [1] * len(prompt_ids)  # every rollout has a prompt of its own
        self.calls.append({"n": len(prompt_ids), "seeds": seeds})
        out = Rollout([], [], [], [])
        for p in prompt_ids:
            text = self.tok.decode(p)
            ids = self.tok(self.script(text, text.count("<tool_response>")), add_special_tokens=False)["input_ids"]
            ids = (ids + [self.tok.eos_token_id])[: sampling.max_tokens]
            self.sampled.append(ids)
            out.prompt_ids.append(list(p))
            out.completion_ids.append(ids)
            out.sampler_logprobs.append([-t / 1000 for t in ids])
            out.truncated.append(False)
        return out


def script(text, answered):
    """Rollout 0 (prompt says 'A'): guesses 3, then 5, then stops. Rollout 1 ('B'): calls the broken tool, then
    stops. Rollout 2 ('C'): answers without a tool."""
    player = text.split("Play ", 1)[1][0]
    turns = {
        "A": [call_text("guess", {"number": 3}), call_text("guess", {"number": 5}), "Got it."],
        "B": [call_text("broken", {"x": 1}), "I give up."],
        "C": ["Five?"],
    }[player]
    return turns[min(answered, len(turns) - 1)]


def prompt_source(tok, rows):
    return PromptSource(
        Dataset.from_list(rows), tok, max_prompt_length=None, context_length=None, max_completion_length=256
    )


def test_each_rollout_acts_in_its_own_environment_across_turns(tok):
    envs = Environments(GuessEnv, [], timeout_s=5)
    rows = [{"prompt": [{"role": "user", "content": f"Play {p}."}], "target": 5} for p in "ABC"]
    prompts = prompt_source(tok, rows)
    generator = ScriptedGenerator(tok, script)
    sampler = EnvironmentSampler(generator, SamplingConfig(max_tokens=200), tok, envs, max_iterations=None)
    rollout = sampler.sample(prompts, [0, 1, 2], [1, 1, 1], seeds=[7, 8, 9])
    instances = rollout.columns["environments"]
    assert len({id(e) for e in instances}) == 3 and envs.last == instances
    # reset(**row): the whole row; its string is appended to the last user message of the prompt the model sees
    assert [e.row["prompt"][0]["content"] for e in instances] == ["Play A.", "Play B.", "Play C."]
    assert "Play A. Guess a number from 1 to 9." in tok.decode(rollout.prompt_ids[0])
    assert '"name": "guess"' in tok.decode(rollout.prompt_ids[0])  # its tools are listed in the prompt
    # the environment kept its state across turns; the failing method became a message, not a crash
    assert instances[0].guesses == [3, 5] and instances[1].guesses == [] and instances[2].guesses == []
    counts = [dict(zip(COUNTS, row)) for row in rollout.tool_counts]
    assert [
        (c["calls"], c["failures"], c["errors"], c["parse_failures"], c["timeouts"], c["turns"]) for c in counts
    ] == [(2, 0, 0, 0, 0, 3), (1, 1, 1, 0, 0, 2), (0, 0, 0, 0, 0, 1)]
    metrics = ToolStats.of(rollout).metrics()
    assert metrics["env/errors"] == pytest.approx(1 / 3) and metrics["episode/turns"] == pytest.approx(2.0)
    assert metrics["tools/calls_per_episode"] == pytest.approx(1.0) and metrics[
        "tools/failure_frequency"
    ] == pytest.approx(1 / 3)
    tool_turns = [m for m in rollout.messages[1] if m["role"] == "tool"]
    assert tool_turns == [
        {
            "role": "tool",
            "name": "broken",
            "content": "Error: tool 'broken' raised RuntimeError: the environment fell over",
        }
    ]
    # token-exact: the trained ids are the sampled ones and the tool turns' rendered ids, in order, and the loss
    # mask is 1 exactly on the sampled ones
    answers = ["higher", "correct"]
    expected, expected_mask = [], []
    sampled_a = [ids for ids, p in zip(generator.sampled, [0, 1, 2, 0, 1, 0]) if p == 0]
    for k, ids in enumerate(sampled_a):
        expected += ids
        expected_mask += [1] * len(ids)
        if k < 2:
            turn = tool_result_ids(tok, [("guess", answers[k])])
            if turn[0] == ids[-1]:
                turn = turn[1:]  # the sampled eos is the template's end of turn
            expected += turn
            expected_mask += [0] * len(turn)
    assert rollout.completion_ids[0] == expected and rollout.tool_mask[0] == expected_mask
    assert [lp for lp, m in zip(rollout.sampler_logprobs[0], expected_mask) if m] == [
        -t / 1000 for t, m in zip(expected, expected_mask) if m
    ]
    # each rollout is seeded from its group's seed and place; the reward it owns scores its own state
    assert len(set(generator.calls[0]["seeds"])) == 3
    assert envs.reward_sources[0](environments=instances) == [1.0, 0.0, 0.0]
    assert envs.reward_sources[0].__name__ == "GuessEnv"


def test_instances_are_reused_round_after_round_and_the_pool_grows_to_the_largest_round(tok):
    envs = Environments(GuessEnv, [], timeout_s=5)
    assert len(envs.pool[None]) == 1  # the probe seeds the pool
    first = envs.take([None, None])
    second = envs.take([None])
    assert len(envs.pool[None]) == 2 and second[0] is first[0]


def test_a_dict_shows_each_rollout_only_its_environments_tools(tok):
    class Counter:
        def reset(self, **row):
            self.count = 0

        def increment(self, step: int) -> int:
            """Add to the counter.

            Args:
                step: How much.
            """
            self.count += step
            return self.count

    envs = Environments({"guess": GuessEnv, "counter": Counter}, [], timeout_s=5)
    assert [f.__name__ for f in envs.tools["counter"]] == ["increment"]
    assert [f.__name__ for f in envs.tools["guess"]] == ["broken", "guess"]
    assert len(envs.reward_sources) == 1  # only GuessEnv owns a reward
    rows = [
        {"prompt": [{"role": "user", "content": "Play C."}], "target": 5, "environment": "guess"},
        {"prompt": [{"role": "user", "content": "Play C."}], "target": 0, "environment": "counter"},
    ]
    prompts = prompt_source(tok, rows)
    rollout = EnvironmentSampler(
        ScriptedGenerator(tok, script), SamplingConfig(max_tokens=64), tok, envs, max_iterations=2
    ).sample(prompts, [0, 1], [1, 1], seeds=None)
    guess_prompt, counter_prompt = (tok.decode(ids) for ids in rollout.prompt_ids)
    assert '"name": "guess"' in guess_prompt and '"increment"' not in guess_prompt
    assert '"name": "increment"' in counter_prompt and '"guess"' not in counter_prompt
    assert [type(e).__name__ for e in rollout.columns["environments"]] == ["GuessEnv", "Counter"]
    assert envs.reward_sources[0](environments=rollout.columns["environments"]) == [0.0, None]


def test_bad_environments_are_refused_before_any_compute_naming_the_fix(tok):
    class NoReset:
        def act(self, x: int) -> int:
            """Act.

            Args:
                x: A value.
            """
            return x

    class Undescribed:
        def reset(self, **row):
            pass

        def act(self, x):
            return x

    with pytest.raises(ValueError, match="without a callable `reset`"):
        Environments(NoReset, [], timeout_s=5)
    with pytest.raises(ValueError, match=r"environment_factory \(Undescribed\): tool 'act' cannot be described"):
        Environments(Undescribed, [], timeout_s=5)
    with pytest.raises(TypeError, match="is not callable"):
        Environments({"a": 3}, [], timeout_s=5)
    with pytest.raises(ValueError, match="empty dict"):
        Environments({}, [], timeout_s=5)
    envs = Environments({"guess": GuessEnv}, [], timeout_s=5)
    no_column = prompt_source(tok, [{"prompt": [{"role": "user", "content": "x"}]}])
    with pytest.raises(ValueError, match="routes each example by its 'environment' column"):
        envs.check_dataset(no_column)
    unknown = prompt_source(tok, [{"prompt": [{"role": "user", "content": "x"}], "environment": "maze"}])
    with pytest.raises(ValueError, match="environment='maze', which is not among the environments"):
        envs.check_dataset(unknown, names_too=True)


def test_environment_owned_data_gets_empty_prompts_that_reset_fills():
    owned = environment_prompts(None, rows=3)
    assert owned["prompt"] == [[{"role": "user", "content": ""}]] * 3
    routed = environment_prompts(Dataset.from_dict({"environment": ["a", "b"]}), rows=3)
    assert routed.column_names == ["environment", "prompt"] and len(routed) == 2


def test_a_generator_that_follows_a_replaced_generate_passes_settings_through_to_the_engine():
    from dsgrpo.rollout.hf_generate import FollowsReplacedGenerate

    class Engine:
        native_weights = True

        def generate(self, *a, **k):
            return "engine"

    class Module:
        pass

    module, engine = Module(), Engine()
    follower = FollowsReplacedGenerate(
        engine, lambda: type("HF", (), {"generate": lambda self, *a, **k: "hf"})(), module
    )
    follower.native_weights = False  # a test or a user switching the engine's sync path
    assert engine.native_weights is False and follower.native_weights is False
    assert follower.generate([[1]], [1], None) == "engine"
    original = follower.generate  # a spy wrapping generate stays on the follower (no recursion)
    follower.generate = lambda *a, **k: "spied " + original(*a, **k)
    assert follower.generate([[1]], [1], None) == "spied engine" and engine.generate() == "engine"
    del follower.__dict__["generate"]
    module.generate = lambda **k: None  # replaced on the instance: generation follows it
    assert follower.generate([[1]], [1], None) == "hf"


# ================================================================================ partial rollouts: episodes across
#                                                                                  rounds
class SteppedEngine:
    """Stands in for vLLM stepped request by request (partial rollouts; unit tests only): a request continues the
    turn its prompt ends in, as `script(conversation so far, turns answered)` plus eos, one token per step."""

    def __init__(self, tok, script):
        self.tok, self.script, self.queue, self.submitted = tok, script, {}, []
        self.header = tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]

    def submit(self, rid, prompt_ids, sampling, max_tokens, seed):
        self.submitted.append(rid)
        h = len(self.header)
        start = max(i for i in range(len(prompt_ids) - h + 1) if prompt_ids[i : i + h] == self.header) + h
        context, so_far = self.tok.decode(prompt_ids[:start]), list(prompt_ids[start:])
        turn = self.tok(self.script(context, context.count("<tool_response>")), add_special_tokens=False)["input_ids"]
        turn = turn + [self.tok.eos_token_id]
        assert turn[: len(so_far)] == so_far  # a carried turn continues where the round cut it
        self.queue[rid] = turn[len(so_far) :][:max_tokens]

    def advance(self):
        out = []
        for rid in list(self.queue):
            token = self.queue[rid].pop(0)
            out.append((rid, [token], [-token / 1000], not self.queue[rid], False))
            if not self.queue[rid]:
                del self.queue[rid]
        return out

    def unfinished(self):
        return len(self.queue)

    def abort(self, ids):
        for rid in ids:
            self.queue.pop(rid, None)


def test_partial_rollouts_carry_an_episode_across_rounds_with_its_environment_alive(tok):
    """Episodes stepped request by request (partial_rollout=True): a round that ends mid-episode carries it, its
    environment keeps its state, and the trained rows equal what the one-call sampler makes of the same turns:
    ids, loss mask, log-probs, conversation and counts. A checkpoint re-runs episodes in flight from reset."""
    from dsgrpo.rollout.partial import InFlight, run_round

    rows = [{"prompt": [{"role": "user", "content": f"Play {p}."}], "target": 5} for p in "ABC"]
    prompts = prompt_source(tok, rows)
    sampler = EnvironmentSampler(
        ScriptedGenerator(tok, script),
        SamplingConfig(max_tokens=200),
        tok,
        Environments(GuessEnv, [], timeout_s=5),
        max_iterations=None,
    )
    whole = sampler.sample(prompts, [0, 1, 2], [1, 1, 1], seeds=None)

    turns = sampler.turns(prompts)
    flight, engine = InFlight(1, 200, turns=turns), SteppedEngine(tok, script)
    for position in range(3):
        flight.add(position, prompt_index=position, first_seed=position)
    a = flight.live[(0, 0)][1]
    assert a.row["prompt"][0]["content"] == "Play A." and a.guesses == []  # reset with its row when it was claimed
    counts = run_round(engine, flight, None, SamplingConfig(max_tokens=200), need=2, version=0)
    assert flight.complete() == [1, 2] and counts["stopped"] == 1  # B and C done; A cut inside an episode
    done = flight.take(2)
    carried = flight.groups[0].members[0]
    assert a.guesses == [3] and carried.turns == 2 and 0 in carried.mask  # a tool turn answered before the cut
    flight.rollout(done, None)

    saved = flight.state()
    counts = run_round(engine, flight, None, SamplingConfig(max_tokens=200), need=1, version=1)
    assert flight.live[(0, 0)][1] is a and a.guesses == [3, 5]  # the same instance went on after the "sync"
    rollout = flight.rollout(flight.take(1), None)
    assert rollout.columns["environments"] == [a] and turns.environments.last == [a]
    for key in ("prompt_ids", "completion_ids", "sampler_logprobs", "tool_mask", "messages"):
        assert getattr(rollout, key)[0] == getattr(whole, key)[0], key
    assert rollout.tool_counts[0][:-1] == whole.tool_counts[0][:-1]  # (the last count is the calls' milliseconds)
    assert set(rollout.weight_versions[0]) == {0, 1} and not flight.live  # mixed versions; nothing left in flight

    resumed = InFlight(1, 200, turns=turns)
    resumed.load(saved)  # an environment cannot be saved: the episode starts again from reset
    episode = resumed.groups[0].members[0]
    fresh = resumed.live[(0, 0)][1]
    assert resumed.rerun_from_reset == 1 and episode.tokens == [] and episode.turns == 1 and fresh is not a
    assert (
        fresh.guesses == [] and fresh.row["prompt"][0]["content"] == "Play A." and episode.prompt == whole.prompt_ids[0]
    )
    run_round(engine, resumed, None, SamplingConfig(max_tokens=200), need=1, version=2)
    again = resumed.rollout(resumed.take(1), None)
    assert again.completion_ids[0] == whole.completion_ids[0] and fresh.guesses == [3, 5]

    stale = InFlight(1, 200, turns=turns)  # an over-stale episode is reset in its own instance
    stale.add(0, prompt_index=0, first_seed=0)
    run_round(engine, stale, None, SamplingConfig(max_tokens=200), need=1, version=0)
    instance = stale.live[(0, 0)][1]
    assert instance.guesses == [3, 5] and stale.restart_stale(version=1, max_staleness=1)[0] == 0
    assert stale.restart_stale(version=5, max_staleness=1)[0] == 1 and instance.guesses == []
    assert stale.live[(0, 0)][1] is instance and stale.groups[0].members[0].tokens == []


class FlakyEnv(GuessEnv):
    """reset() raises for target 3 and hangs for target 4; get_reward() raises for target 6."""

    def reset(self, target, **row):
        if target == 3:
            raise ConnectionError("the game server went away")
        if target == 4:
            import time

            time.sleep(3)
        return super().reset(target, **row)

    def get_reward(self) -> float:
        if self.target == 6:
            raise KeyError("score")
        return super().get_reward()


def test_an_environment_that_raises_or_hangs_is_counted_and_scores_none_and_the_round_goes_on(tok, capsys):
    """TRL ends the run when reset() or get_reward() raises; here, as for tools and agents, the episode scores None
    from its environment, env/errors (raised) or env/timeouts (outlived environment_reset_timeout_s) counts it, the
    first failure is said once, and the other episodes of the round are untouched. A hung instance leaves the pool."""
    envs = Environments(FlakyEnv, [], timeout_s=5, reset_timeout_s=0.5)
    # "Play C." answers without a call: what is counted is the environment's start alone
    rows = [{"prompt": [{"role": "user", "content": "Play C."}], "target": t} for t in (5, 3, 4, 6)]
    prompts = prompt_source(tok, rows)
    sampler = EnvironmentSampler(
        ScriptedGenerator(tok, script), SamplingConfig(max_tokens=200), tok, envs, max_iterations=None
    )
    rollout = sampler.sample(prompts, [0, 1, 2, 3], [1, 1, 1, 1], seeds=None)
    instances = rollout.columns["environments"]
    counts = [dict(zip(COUNTS, row)) for row in rollout.tool_counts]
    assert [(c["errors"], c["timeouts"]) for c in counts] == [(0, 0), (1, 0), (0, 1), (0, 0)]
    # the failed episodes ran from the row's prompt (no observation), the others with reset's string
    assert "Guess a number" in tok.decode(rollout.prompt_ids[0])
    assert "Guess a number" not in tok.decode(rollout.prompt_ids[1])
    assert envs.reward_sources[0](environments=instances) == [0.0, None, None, None]
    said = capsys.readouterr().out
    assert said.count("dsgrpo: warning:") == 1 and "ConnectionError: the game server went away" in said
    assert "env/errors" in said
    metrics = ToolStats.of(rollout).metrics()
    assert metrics["env/errors"] == pytest.approx(1 / 4) and metrics["env/timeouts"] == pytest.approx(1 / 4)
    assert instances[2] not in envs.pool[None] and instances[0] in envs.pool[None]
    # the next round: the instance whose reset raised is reset again and scores as any other
    again = sampler.sample(prompts, [0, 3], [1, 1], seeds=None)
    assert [c[COUNTS.index("errors")] for c in again.tool_counts] == [0, 0]
    assert envs.reward_sources[0](environments=again.columns["environments"]) == [0.0, None]


def test_partial_rollouts_count_an_environment_that_did_not_start(tok):
    from dsgrpo.rollout.partial import InFlight, run_round

    rows = [{"prompt": [{"role": "user", "content": "Play C."}], "target": t} for t in (5, 3)]
    prompts = prompt_source(tok, rows)
    envs = Environments(FlakyEnv, [], timeout_s=5, reset_timeout_s=0.5)
    sampler = EnvironmentSampler(
        ScriptedGenerator(tok, script), SamplingConfig(max_tokens=200), tok, envs, max_iterations=None
    )
    flight = InFlight(1, 200, turns=sampler.turns(prompts))
    for position in range(2):
        flight.add(position, prompt_index=position, first_seed=position)
    run_round(SteppedEngine(tok, script), flight, None, SamplingConfig(max_tokens=200), need=2, version=0)
    rollout = flight.rollout(flight.take(2), None)
    assert [c[COUNTS.index("errors")] for c in rollout.tool_counts] == [0, 1]
    assert envs.reward_sources[0](environments=rollout.columns["environments"]) == [0.0, None]
