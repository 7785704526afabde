"""Agents that run their own loop (rollout/agents.py, rollout/openai_endpoint.py), the pure parts: how an episode's
recorded calls become the trained sequence, how a request's messages are read, and the refusals of agent_rollout.
The endpoint on a real engine, with an agent on 2 ranks: tests/test_api_dist.py (its `agents` check)."""

import pytest

from dsgrpo.rollout.agents import AgentRollout, agent_reward, assemble
from dsgrpo.rollout.openai_endpoint import Call, Choice, Episode, Episodes, RequestError, _answer_matches, \
    normal_message


def call(prompt, ids, extends, lp=-0.5, version=4, answer=None):
    return Call(list(prompt), [Choice(list(ids), [lp] * len(ids), [version] * len(ids), False, answer)], extends)


def test_an_episode_that_appends_trains_as_one_sequence_with_the_tokens_between_masked():
    calls = [call([1, 2], [10, 11, 2], False), call([1, 2, 10, 11, 2, 50, 51], [12, 2], True),
             call([1, 2, 10, 11, 2, 50, 51, 12, 2, 60], [13], True)]
    seq = assemble(calls, [9])
    assert seq["prompt_ids"] == [1, 2]
    assert seq["completion_ids"] == [10, 11, 2, 50, 51, 12, 2, 60, 13]
    assert seq["env_mask"] == [1, 1, 1, 0, 0, 1, 1, 0, 1]
    assert seq["logprobs"] == [-0.5] * 3 + [0.0] * 2 + [-0.5] * 2 + [0.0] + [-0.5]
    assert seq["versions"] == [4] * 9 and seq["turns"] == 3 and not seq["rewritten"]


def test_an_episode_that_rewrote_its_history_trains_its_last_chain():
    calls = [call([1, 2], [10, 2], False), call([1, 7], [11, 2], False), call([1, 7, 11, 2, 5], [12], True)]
    seq = assemble(calls, [9])
    assert seq["prompt_ids"] == [1, 7] and seq["completion_ids"] == [11, 2, 5, 12]
    assert seq["env_mask"] == [1, 1, 0, 1] and seq["turns"] == 2 and seq["rewritten"]
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
    given = {"role": "assistant", "content": None, "refusal": None,
             "tool_calls": [{"id": "call_1", "type": "function",
                             "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]}
    assert normal_message(given, 0) == {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]}
    assert normal_message({"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                          1) == {"role": "user", "content": "ab"}
    assert normal_message({"role": "tool", "content": "5", "name": "add", "tool_call_id": "x"}, 2) == \
        {"role": "tool", "content": "5", "name": "add"}
    for bad, match in (({"role": "wizard", "content": "x"}, r"messages\[3\] must be an object whose role"),
                       ("hello", r"messages\[3\] must be an object"),
                       ({"role": "user", "content": 5}, r"content must be a string"),
                       ({"role": "user", "content": [{"type": "image_url"}]}, "only text parts"),
                       ({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]},
                        "arguments of 'f' are not JSON")):
        with pytest.raises(RequestError, match=match) as err:
            normal_message(bad, 3)
        status, body = err.value.reply()
        assert status == 400 and body["error"]["param"] == "messages" and body["error"]["type"] == \
            "invalid_request_error"
    sent = normal_message(given, 0)
    assert _answer_matches(sent, normal_message(dict(given, content=""), 0))
    assert not _answer_matches(sent, {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 4}}}]})
    assert not _answer_matches(sent, {"role": "user", "content": ""}) and not _answer_matches(None, sent)


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
