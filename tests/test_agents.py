"""Agents that run their own loop (rollout/agents.py, rollout/openai_endpoint.py), the pure parts: how an episode's
recorded calls become the trained sequence, how a request's messages are read, and the refusals of agent_rollout.
The endpoint on a real engine, with an agent on 2 ranks: tests/test_api_dist.py (its `agents` check)."""

import threading

import pytest

from dsgrpo.rollout.agents import AgentRollout, agent_reward, assemble
from dsgrpo.rollout.openai_endpoint import (
    Call,
    Choice,
    Episode,
    Episodes,
    RequestError,
    _answer_matches,
    _version_spans,
    answers_a_call,
    normal_message,
)


def call(prompt, ids, extends, lp=-0.5, version=4, answer=None):
    return Call(list(prompt), [Choice(list(ids), [lp] * len(ids), [version] * len(ids), False, answer)], extends)


def test_an_episode_that_appends_trains_as_one_sequence_with_the_tokens_between_masked():
    calls = [
        call([1, 2], [10, 11, 2], False),
        call([1, 2, 10, 11, 2, 50, 51], [12, 2], True),
        call([1, 2, 10, 11, 2, 50, 51, 12, 2, 60], [13], True),
    ]
    seq = assemble(calls, [9])
    assert seq["prompt_ids"] == [1, 2]
    assert seq["completion_ids"] == [10, 11, 2, 50, 51, 12, 2, 60, 13]
    assert seq["env_mask"] == [1, 1, 1, 0, 0, 1, 1, 0, 1]
    assert seq["logprobs"] == [-0.5] * 3 + [0.0] * 2 + [-0.5] * 2 + [0.0] + [-0.5]
    assert seq["versions"] == [4] * 9 and seq["turns"] == 3 and not seq["rewritten"]


def test_an_episode_that_rewrote_its_history_is_split_at_each_rewrite():
    calls = [call([1, 2], [10, 2], False), call([1, 7], [11, 2], False), call([1, 7, 11, 2, 5], [12], True)]
    seq = assemble(calls, [9])  # every chain: the second trains after its own prompt (a restart at token 2)
    assert seq["prompt_ids"] == [1, 2] and seq["completion_ids"] == [10, 2, 11, 2, 5, 12]
    assert seq["restarts"] == [[2, [1, 7]]] and seq["env_mask"] == [1, 1, 1, 1, 0, 1]
    assert seq["logprobs"] == [-0.5] * 4 + [0.0, -0.5] and seq["turns"] == 3 and seq["rewritten"]
    # padded micro-batches cannot keep two contexts apart in a row: the last chain alone
    seq = assemble(calls, [9], whole=False)
    assert seq["prompt_ids"] == [1, 7] and seq["completion_ids"] == [11, 2, 5, 12] and seq["restarts"] == []
    assert seq["env_mask"] == [1, 1, 0, 1] and seq["turns"] == 2 and seq["rewritten"]
    # a chain that sampled nothing leaves no piece
    assert assemble([call([1, 2], [], False), call([1, 7], [11], False)], [9])["restarts"] == []
    # the chosen choice of an n>1 call is the one the next call continued
    branch = call([1], [3], False)
    branch.choices.append(Choice([4, 2], [-1.0, -1.0], [0, 0], False))
    branch.chosen = 1
    assert assemble([branch, call([1, 4, 2, 8], [6], True)], [9])["completion_ids"] == [4, 2, 8, 6]
    # an episode that made no call keeps its row with nothing to train
    empty = assemble([], [9, 9])
    assert empty["prompt_ids"] == [9, 9] and empty["completion_ids"] == [] and empty["turns"] == 0
    # a call marked as continuing that does not: a bug, said loudly
    with pytest.raises(RuntimeError, match="does not start with the previous call"):
        assemble([call([1], [2], False), call([1, 5], [3], True)], [9])


def test_messages_are_read_as_the_template_reads_them_and_bad_ones_named():
    given = {
        "role": "assistant",
        "content": None,
        "refusal": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
        ],
    }
    assert normal_message(given, 0) == {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}],
    }
    assert normal_message(
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}, 1
    ) == {"role": "user", "content": "ab"}
    assert normal_message({"role": "tool", "content": "5", "name": "add", "tool_call_id": "x"}, 2) == {
        "role": "tool",
        "content": "5",
        "name": "add",
    }
    for bad, match in (
        ({"role": "wizard", "content": "x"}, r"messages\[3\] must be an object whose role"),
        ("hello", r"messages\[3\] must be an object"),
        ({"role": "user", "content": 5}, r"content must be a string"),
        ({"role": "user", "content": [{"type": "image_url"}]}, "only text parts"),
        (
            {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]},
            "arguments of 'f' are not JSON",
        ),
    ):
        with pytest.raises(RequestError, match=match) as err:
            normal_message(bad, 3)
        status, body = err.value.reply()
        assert (
            status == 400 and body["error"]["param"] == "messages" and body["error"]["type"] == "invalid_request_error"
        )
    sent = normal_message(given, 0)
    assert _answer_matches(sent, normal_message(dict(given, content=""), 0))
    assert not _answer_matches(
        sent,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 4}}}],
        },
    )
    assert not _answer_matches(sent, {"role": "user", "content": ""}) and not _answer_matches(None, sent)


def test_a_tool_message_must_answer_a_tool_call():
    user, call = {"role": "user", "content": "2+3?"}, {"type": "function", "function": {"name": "add", "arguments": {}}}
    asked = {"role": "assistant", "content": "", "tool_calls": [call, call]}
    tool = {"role": "tool", "content": "5"}
    answers_a_call([user, asked, tool, tool, {"role": "assistant", "content": "5"}, user])  # two calls, two answers
    for messages, index in (
        ([user, {"role": "assistant", "content": "5"}, tool], 2),  # the assistant made no call
        ([tool], 0),
        ([user, asked, tool, user, tool], 4),  # a user message between
    ):
        with pytest.raises(RequestError, match=rf"messages\[{index}\]: a message with role 'tool' must be"):
            answers_a_call(messages)


def test_weight_versions_are_spans_as_vllm_reports_them():
    assert _version_spans([3, 3, 4, 4, 4]) == [
        {"version": "3", "start": 0, "end": 2},
        {"version": "4", "start": 2, "end": 5},
    ]
    assert _version_spans([]) == [] and _version_spans([7]) == [{"version": "7", "start": 0, "end": 1}]


def test_a_split_episodes_chains_read_apart_as_text():
    from dsgrpo.rollout.batch import CHAIN_MARK, chains_text

    class Letters:  # a tokenizer of one letter per id: what the pure join needs of one
        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(ord("a") + i) for i in ids)

    assert chains_text(Letters(), [0, 1, 2, 3, 4], [[2, [9]], [4, [9, 9]]]) == CHAIN_MARK.join(["ab", "cd", "e"])


def test_only_episodes_the_trainer_opened_are_served():
    episodes = Episodes()
    episodes.open("e1", 64)
    assert isinstance(episodes.get("e1"), Episode) and episodes.get("e1").budget == 64
    for name, status in (("e2", 404), (None, 400)):
        with pytest.raises(RequestError, match="names no open episode") as err:
            episodes.get(name)
        assert err.value.status == status and err.value.code == "unknown_episode"
    assert episodes.close("e1").budget == 64
    with pytest.raises(RequestError):
        episodes.get("e1")


def test_a_split_episode_spends_one_budget_over_its_chains():
    """Every chain of a split episode trains, so max_completion_length holds them together: a call's room is what
    the chains before its own left (the endpoint's _room); an episode whose last chain alone trains spends nothing
    before it."""
    calls = [call([1, 2], [10, 2], False), call([1, 7], [11, 2], False), call([1, 7, 11, 2, 5], [12], True)]
    whole = Episode(64, whole_episode=True, calls=list(calls))
    assert whole.spent(extends=True) == 2  # a call continuing the second chain: the first chain's 2 tokens
    assert whole.spent(extends=False) == 2 + 4  # a third chain: both chains' (the second: 11 2 5 12)
    assert Episode(64, whole_episode=True).spent(extends=False) == 0
    assert Episode(64, calls=list(calls)).spent(extends=False) == 0


def test_agent_rollout_refuses_what_cannot_run_and_its_reward_reads_the_column():
    async def agent(client, row):
        return 1.0

    assert AgentRollout(agent).reports_tool_counts
    with pytest.raises(TypeError, match="must take \\(client, row\\)"):
        AgentRollout(lambda client: 1.0)
    with pytest.raises(TypeError, match="pass the agent function"):
        AgentRollout("agent.py")
    with pytest.raises(ValueError, match="max_concurrent=0"):
        AgentRollout(agent, max_concurrent=0)
    with pytest.raises(ValueError, match="exposes the policy beyond this machine"):
        AgentRollout(agent, host="0.0.0.0")
    assert agent_reward(["a", "b", "c"], [1, None, 0.5]) == [1.0, None, 0.5]


def test_a_streamed_answer_reassembles_to_the_whole_one_in_openais_own_client():
    """stream=true: the reply's chunks over real server-sent events, read back by the openai package's own stream
    accumulator, give the same message, tool calls, finish reason and usage as the whole reply; text completions
    and the usage chunk too."""
    import openai

    from dsgrpo.http import json_server
    from dsgrpo.rollout.openai_endpoint import _answer

    calls = [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}},
        {"id": "call_2", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 1}'}},
    ]
    chat = {
        "id": "chatcmpl-x",
        "object": "chat.completion",
        "created": 1,
        "model": "policy",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Let me add.", "tool_calls": calls},
                "finish_reason": "tool_calls",
                "logprobs": None,
            },
            {
                "index": 1,
                "message": {"role": "assistant", "content": "It is 5."},
                "finish_reason": "stop",
                "logprobs": None,
            },
        ],
        "usage": {"prompt_tokens": 7, "completion_tokens": 11, "total_tokens": 18},
    }
    text = {
        "id": "cmpl-x",
        "object": "text_completion",
        "created": 1,
        "model": "policy",
        "choices": [{"index": 0, "text": " 4 5 6", "finish_reason": "length", "logprobs": None}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6},
    }
    server = json_server(
        {
            ("POST", "/v1/chat/completions"): lambda body: _answer(body, chat),
            ("POST", "/v1/completions"): lambda body: _answer(body, text),
        },
        "127.0.0.1",
        0,
        None,
        2**20,
    )
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.server_address[1]}/v1", api_key="x", max_retries=0)
        whole = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "2+3?"}])
        with client.chat.completions.stream(
            model="policy", messages=[{"role": "user", "content": "2+3?"}], stream_options={"include_usage": True}
        ) as stream:
            streamed = stream.get_final_completion()
        assert [c.message.content for c in streamed.choices] == [c.message.content for c in whole.choices]
        assert [c.finish_reason for c in streamed.choices] == ["tool_calls", "stop"]
        got = [(t.id, t.function.name, t.function.arguments) for t in streamed.choices[0].message.tool_calls]
        assert got == [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in calls]
        assert streamed.usage.total_tokens == 18 and streamed.choices[1].message.tool_calls in (None, [])
        pieces = list(client.completions.create(model="policy", prompt="1 2 3", stream=True))
        assert "".join(p.choices[0].text for p in pieces) == " 4 5 6"
        assert pieces[-1].choices[0].finish_reason == "length"
    finally:
        server.shutdown()
        server.server_close()


def test_an_agent_that_raises_or_hangs_scores_none_and_says_how_and_the_others_go_on(capsys):
    """The episode's own outcome, what env/errors and env/timeouts count (the endpoint on a real engine:
    test_api_dist.py): a raise is an error, a hang past timeout_s a timeout, each None, the rest scored, said once."""
    import asyncio
    import time

    import openai

    def agent(client, row):  # a sync agent: run in a thread, as a user's blocking loop is
        assert client.default_headers["X-Episode-Id"] == row["id"]
        if row["how"] == "raise":
            raise ConnectionError("the tool server went away")
        if row["how"] == "hang":
            time.sleep(3)
        return row["reward"]

    rollout = AgentRollout(agent, timeout_s=0.5)
    base = openai.OpenAI(base_url="http://127.0.0.1:9/v1", api_key="x", max_retries=0)
    rows = [{"id": f"e{i}", "how": how, "reward": 0.25 * i} for i, how in enumerate(["ok", "raise", "hang", "ok"])]

    async def all_episodes():
        gate, start = asyncio.Semaphore(4), time.monotonic()
        out = await asyncio.gather(*(rollout._episode(base, gate, row, row["id"]) for row in rows))
        return out, time.monotonic() - start

    outcomes, seconds = asyncio.run(all_episodes())  # (asyncio.run then waits for the hung thread itself)
    assert outcomes == [(0.0, "ok"), (None, "error"), (None, "timeout"), (0.75, "ok")]
    assert seconds < 2.5  # the hung one was given up at timeout_s, not awaited
    said = capsys.readouterr().out
    assert said.count("dsgrpo: warning:") == 1 and "ConnectionError: the tool server went away" in said
