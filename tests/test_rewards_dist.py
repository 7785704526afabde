"""Reward models sharded over 2 ranks, and mixed reward sources in one training step (real DeepSpeed ZeRO-3)."""

import json
import threading

import pytest

from dsgrpo.rewards.remote import make_server
from launch import torchrun

pytestmark = pytest.mark.dist


def remote_length(prompts, completions, **kwargs):
    return [float(len(c)) for c in completions]


def flapping_length(prompts, completions, _calls=[], _lock=threading.Lock(), **kwargs):
    """remote_length, failing every other request (an overloaded scorer behind a load balancer)."""
    with _lock:
        _calls.append(1)
        if len(_calls) % 2:
            raise RuntimeError("overloaded")
    return remote_length(prompts, completions)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("reward_checks")
    servers = [make_server(remote_length, port=0), make_server(flapping_length, port=0)]
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        torchrun(
            "tests/dist_scripts/reward_checks.py",
            str(out),
            timeout=600,
            env={
                "REMOTE_URL": f"http://127.0.0.1:{servers[0].server_address[1]}/score",
                "FLAPPING_URL": f"http://127.0.0.1:{servers[1].server_address[1]}/score",
            },
        )
    finally:
        for server in servers:
            server.shutdown()
    ranks = [json.load(open(out / f"result-{r}.json")) for r in range(2)]
    for r in ranks:
        for name, value in r.items():
            assert not (isinstance(value, dict) and value.get("error")), f"{name} failed:\n{value['error']}"
    return ranks


def test_a_flapping_scorer_is_retried_and_the_retries_are_counted(results):
    got = results[0]["flapping_scorer"]
    assert got == results[1]["flapping_scorer"]  # reduced over ranks: one figure per round
    assert len(got["retries"]) == 3 and sum(got["retries"]) >= 3  # every round met at least one failure
    # rows a reward could not judge (every other one, on each rank): counted over both ranks, left out of its mean
    assert got["errors"] == [4.0, 4.0, 4.0] and got["unjudged_mean"] == [1.0, 1.0, 1.0]
    assert got["retries"] == [float(int(n)) for n in got["retries"]]
    # the scorer's rewards are real ones (length), never made up for the failed requests
    assert got["remote"] == pytest.approx([10 * x for x in got["local"]], abs=1e-4)


def test_a_scorer_down_at_start_fails_before_any_compute(results):
    for r in results:
        got = r["scorer_down_at_start"]
        assert "cannot be reached" in got["message"] and "checked before training starts" in got["message"]
        assert "dsgrpo serve-reward" in got["message"]
        assert not got["engine_built"]  # the output_dir was never made: nothing ran


def test_sharded_reward_model_scores_like_one_process(results):
    for r in results:
        got = r["sharded_reward_model"]
        assert got["all_partitioned"]
        assert len(got["sharded"]) == 6
        assert max(abs(a - b) for a, b in zip(got["sharded"], got["single"])) <= 1e-5, got
        assert len(set(round(x, 6) for x in got["single"])) > 1  # not a constant


def test_mixed_sources_in_one_step_with_weights(results):
    m = results[0]["mixed_step"]["metrics"]
    names = results[0]["mixed_step"]["names"]
    assert names == ["length_bonus", results[0]["mixed_step"]["names"][1], "remote_length"]
    assert names[1].startswith("qwen2-reward")
    means = [m[f"rewards/{n}/mean"] for n in names]
    assert all(f"rewards/{n}/std" in m for n in names)
    # no source abstained, so the mean of the weighted sum is the weighted sum of the means
    assert m["reward"] == pytest.approx(1.0 * means[0] + 0.5 * means[1] + 2.0 * means[2], abs=1e-4)
    assert means[2] == pytest.approx(10 * means[0], abs=1e-4)  # remote and local saw the same completions
