"""TRL users' sampling settings and policies on 2 ranks (real DeepSpeed ZeRO-3, real in-process vLLM, fp32 CPU).
One launch of tests/dist_scripts/usage_checks.py records numbers; each test asserts on one part of them."""

import json

import pytest

from launch import torchrun

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("usage_checks")
    proc = torchrun("tests/dist_scripts/usage_checks.py", str(out), timeout=1200)
    per_rank = [json.load(open(out / f"result-{r}.json")) for r in range(2)]
    per_rank[0]["_stdout"] = proc.stdout
    return per_rank


def part(results, name):
    ranks = []
    for r, res in enumerate(results):
        if isinstance(res.get(name), dict) and "error" in res[name]:
            pytest.fail(f"check {name} failed on rank {r}:\n{res[name]['error']}")
        ranks.append(res[name])
    return ranks


@pytest.mark.parametrize("setting", ["top_p", "top_k", "min_p"])
def test_truncated_sampling_keeps_learning(results, setting):
    for run in part(results, "truncated_sampling"):
        rows = run[setting]["history"]
        assert run[setting]["moved"] > 1e-2  # the weights move
        for h in rows:
            # the trainer scores the distribution vLLM sampled from: the gap is fp32 rounding, as unfiltered
            assert h["sampling/sampling_logp_difference/max"] <= 1e-3, h
            assert abs(h["sampling/importance_sampling_ratio/mean"] - 1.0) <= 1e-3, h
            assert h["grad_norm"] > 0.1, h


def test_the_old_behaviour_stopped_learning_and_now_says_so(results):
    """With the trainer scoring the unfiltered distribution (dsgrpo before), top_k=10 left a gap of about 4 nats a
    token, correction weights of 0 and a zero gradient; the run now prints why."""
    for run in part(results, "truncated_sampling"):
        rows = run["top_k_as_before"]["history"]
        assert all(h["sampling/sampling_logp_difference/mean"] > 1.0 for h in rows)
        assert all(h["sampling/importance_sampling_ratio/mean"] < 1e-3 and h["grad_norm"] < 1e-6 for h in rows)
    assert "the policy is barely learning" in results[0]["_stdout"]
