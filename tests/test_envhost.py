"""The environment host's machinery in one process (issue 66): the protocol against the real host program, its
supervision (a host that cannot start, one that dies mid-episode, one that dies too often), the branch check, and
the venv cache. The host training a verifiers v1 environment in its own venv on 2 ranks is in
tests/dist_scripts/api_checks.py (the env_host check)."""

import asyncio
import os
import sys
import time
from types import SimpleNamespace

import pytest

from dsgrpo.envhost import venvs
from dsgrpo.envhost.process import EnvHost, EnvHostError, HostDied
from dsgrpo.envhost.rollout import EnvHostRollout, branch_mismatch

MODULES = os.path.join(os.path.dirname(__file__), "envhost_modules")


def host(function="echo", **kw):
    return EnvHost(f"python:toy_episodes:{function}", sys.executable, paths=[MODULES], **kw).start()


def episode(h, row, episode_id="e1"):
    return asyncio.run(h.episode(row, base_url="http://x/v1", episode_id=episode_id, model="policy", tokenizer="t"))


def test_the_host_answers_rows_and_concurrent_episodes_and_what_the_environment_prints_stays_out():
    h = host(env={"DSGRPO_ENDPOINT_KEY": "secret"})
    try:
        assert h.versions["python"] == sys.version.split()[0]
        assert h.rows(2) == [
            {"prompt": [{"role": "user", "content": "Say 0"}], "task_index": 0},
            {"prompt": [{"role": "user", "content": "Say 1"}], "task_index": 1},
        ]

        async def many():
            return await asyncio.gather(
                *(
                    h.episode(
                        {"task_index": i, "sleep": 0.5},
                        base_url="http://x/v1",
                        episode_id=f"e{i}",
                        model="m",
                        tokenizer="t",
                    )
                    for i in range(8)
                )
            )

        start = time.time()
        answers = asyncio.run(many())
        assert time.time() - start < 3.0  # 8 episodes of 0.5 s each ran at once, not one after another
        assert [a["reward"] for a in answers] == [float(i) for i in range(8)]
        assert [a["echo"][:4] for a in answers] == [["http://x/v1", f"e{i}", "m", "secret"] for i in range(8)]
        assert answers[2]["metrics"] == {"seen": 1.0, "index": 2.0} and answers[0]["error"] is None
        failed = episode(h, {"task_index": 0, "fail": True})
        assert failed["reward"] is None and failed["error"] == "ValueError: the environment broke"
        assert episode(h, {"task_index": 5})["reward"] == 5.0  # the host goes on after an episode failed
        assert "an environment that prints to stdout" in open(h.log_path).read()
    finally:
        h.close()
    assert not h.alive()


def test_a_host_that_cannot_start_is_a_clear_error_in_bounded_time():
    start = time.time()
    with pytest.raises(EnvHostError) as err:
        EnvHost("python:no_such_module:f", sys.executable, paths=[MODULES], start_timeout_s=60).start()
    assert "did not start" in str(err.value) and "No module named 'no_such_module'" in str(err.value)
    assert time.time() - start < 30
    with pytest.raises(EnvHostError, match="cannot run"):
        EnvHost("python:toy_episodes:echo", "/nonexistent/python").start()
    with pytest.raises(ValueError, match="verifiers:TASKSET_MODULE"):
        EnvHostRollout("gym:CartPole")


def test_a_host_that_dies_fails_its_episodes_and_is_started_again_within_its_restarts():
    h = EnvHost("python:toy_episodes:die", sys.executable, paths=[MODULES], max_restarts=1).start()
    try:
        first_pid = h._process.pid

        async def two():
            return await asyncio.gather(
                *(
                    h.episode({"sleep": 0.3}, base_url="u", episode_id=f"e{i}", model="m", tokenizer="t")
                    for i in range(2)
                ),
                return_exceptions=True,
            )

        lost = asyncio.run(two())
        assert all(isinstance(x, HostDied) for x in lost), lost  # both episodes it held fail, none hangs
        assert "code 3" in str(lost[0])
        with pytest.raises(HostDied):
            episode(h, {"sleep": 0})  # started again (restart 1 of 1), and dies again
        assert h.restarts == 1 and h._process.pid != first_pid
        with pytest.raises(EnvHostError, match="died 2 times"):
            episode(h, {"sleep": 0})
    finally:
        h.close()


def test_an_episode_the_trainer_gives_up_on_is_cancelled_in_the_host():
    """An episode that hangs in the environment and hits the trainer's timeout (or is discarded as stale) is
    cancelled in the host too: it does not hold the host's loop for the rest of the run, and the host goes on."""
    h = host()
    try:

        async def give_up():
            await asyncio.wait_for(
                h.episode({"task_index": 0, "sleep": 600}, base_url="u", episode_id="hung", model="m", tokenizer="t"),
                0.5,
            )

        with pytest.raises(asyncio.TimeoutError):
            asyncio.run(give_up())
        deadline = time.time() + 10
        while "episode hung cancelled" not in open(h.log_path).read() and time.time() < deadline:
            time.sleep(0.1)
        assert "episode hung cancelled (the trainer gave up on it)" in open(h.log_path).read()
        assert h._pending == {}
        assert episode(h, {"task_index": 4})["reward"] == 4.0  # the host goes on
    finally:
        h.close()


def test_the_ecosystems_own_metrics_are_means_over_the_episodes_since_the_last_log():
    rollout = EnvHostRollout("python:toy_episodes:echo")
    rollout.env_host, rollout.endpoint, rollout._tokenizer_path = host(), SimpleNamespace(url="u"), "t"
    try:
        for i in (1, 2, 6):
            assert asyncio.run(rollout.play(None, {"task_index": i}, f"e{i}")) == float(i)
        means = {"env_metrics/seen": 1.0, "env_metrics/index": 3.0}
        assert rollout.round_metrics() == (means, {"env_metrics/seen": 3.0, "env_metrics/index": 3.0})
        assert rollout.round_metrics() == ({}, {})  # a window: logged once
        assert rollout.metrics == {"seen": 3.0, "index": 9.0}  # the run's total stays
    finally:
        rollout.env_host.close()


def _call(prompt, ids, logprobs, extends):
    from dsgrpo.rollout.openai_endpoint import Call, Choice

    return Call(prompt, [Choice(ids, logprobs, [0] * len(ids), False, None)], extends)


def test_the_hosts_branches_must_be_the_endpoints_record():
    """A two-call episode (the second call continues the first) is one chain: prompt, sampled, inserted, sampled."""
    calls = [_call([1, 2], [5, 6], [-0.5, -0.25], False), _call([1, 2, 5, 6, 9], [7], [-1.0], True)]
    good = {
        "token_ids": [1, 2, 5, 6, 9, 7],
        "sampled_mask": [False, False, True, True, False, True],
        "logprobs": [0.0, 0.0, -0.5, -0.25, 0.0, -1.0],
    }
    assert branch_mismatch(calls, [good]) is None
    assert branch_mismatch(calls, [dict(good, logprobs=None)]) is None
    assert "differs from every recorded chain (first at token 4)" in branch_mismatch(
        calls, [dict(good, token_ids=[1, 2, 5, 6, 8, 7])]
    )
    assert "sampled tokens" in branch_mismatch(calls, [dict(good, sampled_mask=[False] * 2 + [True] * 4)])
    assert "log-probs" in branch_mismatch(calls, [dict(good, logprobs=[0, 0, -0.5, -0.3, 0, -1.0])])
    assert "2 branch(es), the endpoint recorded 1" in branch_mismatch(calls, [good, good])
    # a rewritten history: two chains, two branches in either order
    split = calls + [_call([3], [4], [-2.0], False)]
    other = {"token_ids": [3, 4], "sampled_mask": [False, True], "logprobs": [0.0, -2.0]}
    assert branch_mismatch(split, [other, good]) is None


def test_a_refused_episode_scores_none_and_counts_as_an_error():
    rollout = EnvHostRollout("python:toy_episodes:echo")
    calls = [_call([1, 2], [5], [-0.5], False)]
    rollout.branches = {"a": [{"token_ids": [1, 2, 6], "sampled_mask": [False, False, True]}], "b": None}
    assert rollout.checked("a", SimpleNamespace(calls=calls), 1.0, "ok") == (None, "error")
    assert rollout.checked("b", SimpleNamespace(calls=calls), 1.0, "ok") == (1.0, "ok")  # no token ids reported


def test_an_ecosystems_venv_is_built_once_and_cached_by_its_requirements(tmp_path, monkeypatch):
    monkeypatch.setenv("DSGRPO_ENV_CACHE", str(tmp_path / "cache"))
    requirements = tmp_path / "tiny.txt"
    requirements.write_text("# nothing beyond the standard library\n")
    with pytest.raises(FileNotFoundError, match="shipped: .*verifiers"):
        venvs.requirements_file("no-such-ecosystem")
    assert venvs.requirements_file("verifiers") == venvs.shipped_requirements() / "verifiers.txt"
    assert "verifiers==0.4.0" in (venvs.shipped_requirements() / "verifiers.txt").read_text()
    logged = []
    python = venvs.ensure_venv(str(requirements), log=logged.append)
    assert python.exists() and len(logged) == 2
    assert venvs.ensure_venv(str(requirements), log=logged.append) == python and len(logged) == 2  # cached
    h = EnvHost("python:toy_episodes:echo", str(python), paths=[MODULES]).start()  # the host runs in it
    try:
        assert episode(h, {"task_index": 2})["echo"][4] != os.getpid()
    finally:
        h.close()
    requirements.write_text("# a changed pin is a new venv\n")
    assert venvs.venv_dir(requirements) != python.parent.parent
    (python.parent.parent / venvs.READY).unlink()  # a build that died is rebuilt
    assert venvs.ensure_venv(str(tmp_path / "tiny.txt"), log=logged.append) != python
