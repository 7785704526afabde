"""Tool calling during rollout (dsgrpo/rollout/tools.py): schemas, call parsing, the time-limited runner, and the
generate → run tools → continue loop, against a scripted generator standing in for vLLM."""

import json
import re
import threading
import time

import pytest
import torch

from dsgrpo.rollout.base import Rollout, SamplingConfig, round_seed
from dsgrpo.rollout.tools import (
    ToolCall,
    ToolRunner,
    ToolStats,
    parse_tool_calls,
    run_tool_turns,
    tool_result_ids,
    tool_schemas,
)


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression of integers.

    Args:
        expression: The expression, e.g. "2 + 3".
    """
    if not re.fullmatch(r"[\d\s+\-*()]+", expression):
        raise ValueError(f"unsupported characters in {expression!r}")
    return str(eval(expression))


def explode(reason: str) -> str:
    """Always fails.

    Args:
        reason: Why.
    """
    raise RuntimeError(f"boom: {reason}")


RELEASE = threading.Event()  # set at teardown so the abandoned thread of `hang` ends


def hang() -> str:
    """Never answers in time."""
    RELEASE.wait(10)
    return "too late"


@pytest.fixture(autouse=True)
def _release_hung_tools():
    RELEASE.clear()
    yield
    RELEASE.set()


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from dsgrpo.testing import tiny_tokenizer

    return AutoTokenizer.from_pretrained(tiny_tokenizer())


def logprob_of(token_id: int) -> float:
    """The stub's log-prob of a sampled token: a function of the token, so alignment can be checked anywhere."""
    return -token_id / 1000


class ScriptedGenerator:
    """Stands in for vLLM (unit tests only): completion k of a prompt is `script(prompt_text, k)` tokenized plus eos,
    cut at max_tokens (and then marked truncated). Records every call."""

    def __init__(self, tok, script):
        self.tok, self.script, self.calls = tok, script, []

    def generate(self, prompt_ids, counts, sampling, seeds=None):
        self.calls.append(
            {
                "prompt_ids": [list(p) for p in prompt_ids],
                "counts": list(counts),
                "max_tokens": sampling.max_tokens,
                "seeds": seeds,
            }
        )
        out = Rollout([], [], [], [])
        for p, n in zip(prompt_ids, counts):
            for k in range(n):
                ids = self.tok(self.script(self.tok.decode(p), k), add_special_tokens=False)["input_ids"]
                ids = ids + [self.tok.eos_token_id]
                out.prompt_ids.append(list(p))
                out.completion_ids.append(ids[: sampling.max_tokens])
                out.sampler_logprobs.append([logprob_of(t) for t in ids[: sampling.max_tokens]])
                out.truncated.append(len(ids) > sampling.max_tokens)
        return out


def trl_metrics(stats):
    """The two tools/* metrics TRL logs (the others: test_tool_stats_metrics_and_weights)."""
    return {k: v for k, v in stats.metrics().items() if k in ("tools/call_frequency", "tools/failure_frequency")}


def call_text(name, arguments):
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def last_tool_response(prompt_text):
    return prompt_text.rsplit("<tool_response>\n", 1)[1].split("\n</tool_response>")[0]


def chat_prompt(tok, question, tools):
    text = tok.apply_chat_template(
        [{"role": "user", "content": question}], tools=tool_schemas(tools), tokenize=False, add_generation_prompt=True
    )
    return tok(text, add_special_tokens=False)["input_ids"]


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


# ================================================================================================== schemas
def test_calculator_schema():
    assert tool_schemas([calculator]) == [
        {
            "type": "function",
            "function": {
                "name": "calculator",
                "description": "Evaluate an arithmetic expression of integers.",
                "parameters": {
                    "type": "object",
                    "properties": {"expression": {"type": "string", "description": 'The expression, e.g. "2 + 3".'}},
                    "required": ["expression"],
                },
                "return": {"type": "string"},
            },
        }
    ]


def test_schema_errors_name_the_tool_and_the_fix():
    def no_hints(x):
        """Doc.

        Args:
            x: A value.
        """

    def no_args_doc(x: int) -> int:
        """Doc without an Args section."""

    for fn in (no_hints, no_args_doc):
        with pytest.raises(ValueError, match=rf"tool '{fn.__name__}' cannot be described.*type hint.*'Args:'"):
            tool_schemas([fn])
    with pytest.raises(ValueError, match="two tools are named 'calculator'"):
        tool_schemas([calculator, calculator])
    with pytest.raises(ValueError, match="tools must be functions"):
        tool_schemas(["calculator"])


def test_the_template_lists_tools_in_the_system_turn_and_renders_tool_turns_qwen_style(tok):
    text = tok.apply_chat_template(
        [
            {"role": "user", "content": "2+3?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "2+3"}}}
                ],
            },
            {"role": "tool", "name": "calculator", "content": "5"},
        ],
        tools=tool_schemas([calculator]),
        tokenize=False,
        add_generation_prompt=True,
    )
    assert text.startswith("<|im_start|>system\n# Tools\n\nYou may call one or more functions")
    assert '\n<tools>\n{"type": "function", "function": {"name": "calculator"' in text
    assert text.endswith(
        "<|im_start|>user\n2+3?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n"
        '{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    # without tools: plain ChatML, as before tools existed
    plain = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "U"},
        {"role": "assistant", "content": "A"},
    ]
    assert (
        tok.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)
        == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\nA<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


# ================================================================================================== parsing
def test_parse_several_calls_and_string_arguments():
    text = (
        "Let me compute.\n"
        + call_text("calculator", {"expression": "2 + 3"})
        + "\n"
        + '<tool_call>\n{"name": "calculator", "arguments": "{\\"expression\\": \\"4 * 5\\"}"}\n</tool_call>'
        + "<|im_end|>"
    )
    assert parse_tool_calls(text) == [
        ToolCall("calculator", {"expression": "2 + 3"}),
        ToolCall("calculator", {"expression": "4 * 5"}),
    ]
    assert parse_tool_calls("no calls here") == []


def test_malformed_calls_become_failed_calls_not_exceptions():
    bad_json, no_name, bad_args, unclosed = parse_tool_calls(
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 3"}\n</tool_call>'
        '<tool_call>\n{"arguments": {}}\n</tool_call>'
        '<tool_call>\n{"name": "calculator", "arguments": [1, 2]}\n</tool_call>'
        '<tool_call>\n{"name": "calc'
    )
    assert bad_json.error.startswith("the tool call is not valid JSON (Expecting ',' delimiter")
    assert bad_json.error.endswith(
        'Write calls as <tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )
    assert no_name.error.startswith('the tool call has no "name" string.')
    assert (
        bad_args.name == "calculator"
        and bad_args.error == "the \"arguments\" of 'calculator' must be a JSON object, got [1, 2]."
    )
    assert unclosed.error.startswith("<tool_call> without a closing </tool_call>.")


# ================================================================================================== runner
def test_runner_results_and_errors():
    runner = ToolRunner([calculator, explode, hang], timeout_s=0.2)
    assert runner.run(ToolCall("calculator", {"expression": "2 + 3 * 4"})) == ("14", True)
    assert runner.run(ToolCall("explode", {"reason": "x"})) == (
        "Error: tool 'explode' raised RuntimeError: boom: x",
        False,
    )
    assert runner.run(ToolCall("nope", {})) == (
        "Error: unknown tool 'nope'. Available tools: calculator, explode, hang.",
        False,
    )
    text, ok = runner.run(ToolCall("calculator", {"expr": "1"}))  # wrong argument name: the TypeError is reported
    assert not ok and text.startswith("Error: tool 'calculator' raised TypeError:") and "'expr'" in text
    assert runner.run(ToolCall(None, {}, "bad")) == ("Error: bad", False)
    start = time.monotonic()
    assert runner.run(ToolCall("hang", {})) == ("Error: tool 'hang' timed out after 0.2 s.", False)
    assert time.monotonic() - start < 1.0


def test_runner_formats_non_text_results_and_awaits_async_tools():
    async def lookup(key: str) -> dict:
        """Look a key up.

        Args:
            key: The key.
        """
        return {"key": key, "value": 3}

    assert ToolRunner([lookup], timeout_s=1).run(ToolCall("lookup", {"key": "k"})) == ('{"key": "k", "value": 3}', True)
    with pytest.raises(ValueError, match="timeout_s=0"):
        ToolRunner([calculator], timeout_s=0)


def test_tool_stats_metrics_and_weights():
    # 4 completions made 3 calls, 1 failed: 3/4 calls per completion (weight 4), 1/3 failures per call (weight 3);
    # per episode (weight 4): 1 parse failure, 2 errors, 1 timeout, 6 turns; 900 ms over 3 calls: 0.3 s a call
    stats = ToolStats(completions=4, calls=3, failures=1, parse_failures=1, errors=2, timeouts=1, turns=6, tool_ms=900)
    assert stats.metrics() == {
        "tools/call_frequency": 0.75,
        "tools/failure_frequency": pytest.approx(1 / 3),
        "tools/calls_per_episode": 0.75,
        "tools/parse_failures": 0.25,
        "env/errors": 0.5,
        "env/timeouts": 0.25,
        "env/step_s": pytest.approx(0.3),
        "episode/turns": 1.5,
        "episode/rewritten": 0.0,
    }
    assert stats.weights() == {
        "tools/call_frequency": 4.0,
        "tools/failure_frequency": 3.0,
        "tools/calls_per_episode": 4.0,
        "tools/parse_failures": 4.0,
        "env/errors": 4.0,
        "env/timeouts": 4.0,
        "env/step_s": 3.0,
        "episode/turns": 4.0,
        "episode/rewritten": 4.0,
    }
    assert ToolStats(completions=2).metrics()["tools/failure_frequency"] == 0.0
    # rows of a checkpoint written before the counts grew ([calls, failures]) read the rest as 0
    old = ToolStats.of(Rollout([[1]], [[2]], [[0.0]], [False], tool_counts=[[2, 1]]))
    assert (old.calls, old.failures, old.turns) == (2, 1, 0)


# ================================================================================================== the loop
TURN_5 = "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


def test_tool_result_ids_are_the_templates_tool_turn(tok):
    assert tool_result_ids(tok, [("calculator", "5")]) == ids(tok, "<|im_end|>" + TURN_5)
    assert (
        tok.decode(tool_result_ids(tok, [("calculator", "5"), ("calculator", "6")]))
        == "<|im_end|>\n<|im_start|>user\n<tool_response>\n5\n</tool_response>\n<tool_response>\n6\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_tool_call_is_answered_and_the_model_continues(tok):
    call = call_text("calculator", {"expression": "2 + 3"})

    def script(prompt_text, k):
        if "<tool_response>" in prompt_text:
            return f"The answer is {last_tool_response(prompt_text)}."
        return call if k == 0 else "It is 5."  # completion 0 calls the tool, completion 1 answers at once

    gen = ScriptedGenerator(tok, script)
    prompt = chat_prompt(tok, "What is 2 + 3?", [calculator])
    rollout, stats = run_tool_turns(
        gen,
        tok,
        [prompt],
        [2],
        SamplingConfig(max_tokens=200),
        [11],
        ToolRunner([calculator], timeout_s=1),
        max_tool_calling_iterations=3,
    )
    eos = tok.eos_token_id
    sampled_1, turn, sampled_2 = ids(tok, call) + [eos], ids(tok, TURN_5), ids(tok, "The answer is 5.") + [eos]
    assert rollout.prompt_ids == [prompt, prompt]
    assert rollout.completion_ids[0] == sampled_1 + turn + sampled_2  # the model's eos is not repeated
    assert rollout.tool_mask[0] == [1] * len(sampled_1) + [0] * len(turn) + [1] * len(sampled_2)
    assert rollout.sampler_logprobs[0] == [logprob_of(t) for t in sampled_1] + [0.0] * len(turn) + [
        logprob_of(t) for t in sampled_2
    ]
    direct = ids(tok, "It is 5.") + [eos]
    assert rollout.completion_ids[1] == direct and rollout.tool_mask[1] == [1] * len(direct)
    assert rollout.truncated == [False, False]
    # what the reward functions get (TRL's shape): the turns as messages, tool calls and results included
    assert rollout.messages[0] == [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "2 + 3"}}}
            ],
        },
        {"role": "tool", "name": "calculator", "content": "5"},
        {"role": "assistant", "content": "The answer is 5."},
    ]
    assert rollout.messages[1] == [{"role": "assistant", "content": "It is 5."}]
    # the continuation: n=1 from prompt + everything so far, the room left, a seed from (seed, iteration, k)
    assert len(gen.calls) == 2
    assert gen.calls[1] == {
        "prompt_ids": [prompt + sampled_1 + turn],
        "counts": [1],
        "max_tokens": 200 - len(sampled_1 + turn),
        "seeds": [round_seed(11, 1, 0)],
    }
    assert (stats.completions, stats.calls, stats.failures) == (2, 1, 0)
    assert trl_metrics(stats) == {"tools/call_frequency": 0.5, "tools/failure_frequency": 0.0}
    # tool tokens stay in input_ids but leave the loss
    t = rollout.tensors(tok.pad_token_id)
    P, T = len(prompt), len(rollout.completion_ids[0])
    assert t["input_ids"][0, P:].tolist() == rollout.completion_ids[0]
    assert t["completion_mask"][0].tolist() == rollout.tool_mask[0]
    assert t["completion_mask"][1].tolist() == [1.0] * len(direct) + [0.0] * (T - len(direct))
    assert t["sampler_logps"][0].tolist() == pytest.approx(rollout.sampler_logprobs[0])


def test_in_lockstep_a_rank_without_turns_to_continue_joins_each_call_with_no_rows(tok):
    """A tensor-parallel engine's ranks make the same calls: while another rank continues (the lockstep answers
    True), this rank, whose completion answered at once, calls with no rows; the loop ends when no rank continues."""
    gen = ScriptedGenerator(tok, lambda prompt_text, k: "It is 5.")
    others = iter([True, True, False])  # the other rank continues twice
    asked = []

    def lockstep(mine):
        asked.append(mine)
        return mine or next(others)

    prompt = chat_prompt(tok, "What is 2 + 3?", [calculator])
    rollout, _ = run_tool_turns(
        gen,
        tok,
        [prompt],
        [1],
        SamplingConfig(max_tokens=50),
        [11],
        ToolRunner([calculator], timeout_s=1),
        max_tool_calling_iterations=5,
        lockstep=lockstep,
    )
    assert asked == [False, False, False] and [c["prompt_ids"] for c in gen.calls] == [[prompt], [], []]
    assert rollout.completion_ids[0] == ids(tok, "It is 5.") + [tok.eos_token_id]


def test_failing_tools_are_reported_to_the_model_and_the_run_continues(tok):
    calls = "".join(
        [
            call_text("calculator", {"expression": "2 + 3"}),
            call_text("explode", {"reason": "why"}),
            call_text("hang", {}),
            '<tool_call>\n{"name": "calculator", "arguments": {\n</tool_call>',
            call_text("search", {"q": "x"}),
        ]
    )

    def script(prompt_text, k):
        return "Done." if "<tool_response>" in prompt_text else calls

    gen = ScriptedGenerator(tok, script)
    prompt = chat_prompt(tok, "Go.", [calculator, explode, hang])
    start = time.monotonic()
    runner = ToolRunner([calculator, explode, hang], timeout_s=0.2)
    rollout, stats = run_tool_turns(
        gen, tok, [prompt], [1], SamplingConfig(max_tokens=2000), [0], runner, max_tool_calling_iterations=1
    )
    assert time.monotonic() - start < 3.0  # the hung tool cost its 0.2 s, not its 10 s
    mask = rollout.tool_mask[0]
    inserted = tok.decode([t for t, m in zip(rollout.completion_ids[0], mask) if m == 0])
    responses = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", inserted, re.DOTALL)
    assert responses[0] == "5"
    assert responses[1] == "Error: tool 'explode' raised RuntimeError: boom: why"
    assert responses[2] == "Error: tool 'hang' timed out after 0.2 s."
    assert responses[3].startswith("Error: the tool call is not valid JSON")
    assert responses[4] == "Error: unknown tool 'search'. Available tools: calculator, explode, hang."
    assert tok.decode(rollout.completion_ids[0]).endswith("<|im_start|>assistant\nDone.<|im_end|>")
    assert rollout.truncated == [False]
    assert (stats.calls, stats.failures) == (5, 4)
    first, tools, last = rollout.messages[0][0], rollout.messages[0][1:-1], rollout.messages[0][-1]
    assert [c["function"]["name"] for c in first["tool_calls"]] == ["calculator", "explode", "hang", "search"]
    assert [(m["role"], m["name"]) for m in tools] == [
        ("tool", "calculator"),
        ("tool", "explode"),
        ("tool", "hang"),
        ("tool", "unknown"),
        ("tool", "search"),
    ]
    assert [m["content"] for m in tools] == responses
    assert last == {"role": "assistant", "content": "Done."}
    assert trl_metrics(stats) == {"tools/call_frequency": 5.0, "tools/failure_frequency": 0.8}


def test_iteration_limit_leaves_later_calls_unanswered(tok):
    call = call_text("calculator", {"expression": "1 + 1"})
    gen = ScriptedGenerator(tok, lambda prompt_text, k: call)  # a model that calls the tool on every turn
    prompt = chat_prompt(tok, "Loop.", [calculator])
    runner = ToolRunner([calculator], timeout_s=1)
    one = ids(tok, call) + [tok.eos_token_id]
    turn = ids(tok, TURN_5.replace("5", "2"))
    for limit, expected in ((0, one), (1, one + turn + one), (2, one + turn + one + turn + one)):
        gen.calls.clear()
        rollout, stats = run_tool_turns(
            gen, tok, [prompt], [1], SamplingConfig(max_tokens=1000), None, runner, max_tool_calling_iterations=limit
        )
        assert rollout.completion_ids[0] == expected and stats.calls == limit
        # every turn calls the tool; only the first `limit` are answered, the last call stays unanswered
        assert [m["role"] for m in rollout.messages[0]] == ["assistant", "tool"] * limit + ["assistant"]
        assert "tool_calls" in rollout.messages[0][-1]
        assert len(gen.calls) == limit + 1 and all(c["seeds"] is None for c in gen.calls)


class RoutedScriptedGenerator(ScriptedGenerator):
    """ScriptedGenerator that also reports routes as a MoE generate does: every position of prompt + completion
    but the last (never fed back), each route naming its call and position; the last is -1."""

    def generate(self, prompt_ids, counts, sampling, seeds=None):
        out = super().generate(prompt_ids, counts, sampling, seeds)
        call = len(self.calls)
        out.routes = []
        for p, c in zip(out.prompt_ids, out.completion_ids):
            n = len(p) + len(c)
            r = torch.stack([torch.full((n,), call), torch.arange(n)], dim=-1).view(n, 1, 2).to(torch.int16)
            r[-1] = -1
            out.routes.append(r)
        return out


def test_a_tool_completions_routes_are_those_each_token_was_sampled_with(tok):
    """Routing replay with tools: positions the first call fed keep its routes (they made the log-probs of the tokens
    it sampled); the continuation's prefill supplies the tool turn's and the first turn's last token's."""
    call = call_text("calculator", {"expression": "2 + 3"})
    gen = RoutedScriptedGenerator(
        tok, lambda text, k: "The answer is 5." if "<tool_response>" in text else (call if k == 0 else "It is 5.")
    )
    prompt = chat_prompt(tok, "What is 2 + 3?", [calculator])
    rollout, _ = run_tool_turns(
        gen,
        tok,
        [prompt],
        [2],
        SamplingConfig(max_tokens=200),
        [11],
        ToolRunner([calculator], timeout_s=1),
        max_tool_calling_iterations=3,
    )
    P, first = len(prompt), len(ids(tok, call)) + 1  # the first turn: call + eos
    total = P + len(rollout.completion_ids[0])
    routes = rollout.routes[0][:, 0]
    assert routes.shape == (total, 2) and len(rollout.routes[1]) == P + len(rollout.completion_ids[1])
    fed_by_first = P + first - 1
    assert routes[:fed_by_first, 0].eq(1).all() and torch.equal(
        routes[:fed_by_first, 1].long(), torch.arange(fed_by_first)
    )
    assert routes[fed_by_first : total - 1, 0].eq(2).all()  # the continuation's call
    assert torch.equal(routes[fed_by_first : total - 1, 1].long(), torch.arange(fed_by_first, total - 1))
    assert routes[-1].eq(-1).all()  # the last token: never fed
    assert torch.equal(
        rollout.routes[1][:, 0, 0], torch.tensor([1] * (len(rollout.routes[1]) - 1) + [-1], dtype=torch.int16)
    )
    # the tool turn cut at max_tokens: no call read it, so the trainer routes it (-1); the first turn's last token
    # was never fed either
    limit = first + 3
    gen = RoutedScriptedGenerator(tok, gen.script)
    rollout, _ = run_tool_turns(
        gen,
        tok,
        [prompt],
        [1],
        SamplingConfig(max_tokens=limit),
        [11],
        ToolRunner([calculator], timeout_s=1),
        max_tool_calling_iterations=3,
    )
    routes = rollout.routes[0][:, 0]
    assert len(rollout.completion_ids[0]) == limit and routes.shape[0] == P + limit and len(gen.calls) == 1
    assert routes[:fed_by_first, 0].eq(1).all() and routes[fed_by_first:].eq(-1).all()
    # a generator without routes: none
    rollout, _ = run_tool_turns(
        ScriptedGenerator(tok, gen.script),
        tok,
        [prompt],
        [1],
        SamplingConfig(max_tokens=200),
        [11],
        ToolRunner([calculator], timeout_s=1),
        3,
    )
    assert rollout.routes is None


def test_truncation_at_max_tokens(tok):
    eos = tok.eos_token_id
    short = call_text("calculator", {"expression": "2 + 3"})
    long_ = call_text("calculator", {"expression": "20 + 30 + 40 + 50"})

    def script(prompt_text, k):
        if "<tool_response>" in prompt_text:
            return "The answer is in the tool response above."
        return short if k == 0 else long_

    prompt = chat_prompt(tok, "Two.", [calculator])
    runner = ToolRunner([calculator], timeout_s=1)
    sofar_0 = ids(tok, short) + [eos] + ids(tok, TURN_5)
    sofar_1 = ids(tok, long_) + [eos] + ids(tok, TURN_5.replace("5", "140"))
    done = ids(tok, "The answer is in the tool response above.") + [eos]

    # both continue in one call with the larger room; row 0's answer just fits, row 1's is cut at its own room
    limit = len(sofar_0) + len(done)
    assert 0 < limit - len(sofar_1) < len(done)  # row 1 has some room, less than its answer needs
    gen = ScriptedGenerator(tok, script)
    rollout, _ = run_tool_turns(gen, tok, [prompt], [2], SamplingConfig(max_tokens=limit), [3], runner, 2)
    assert gen.calls[1]["max_tokens"] == len(done)
    assert rollout.completion_ids[0] == sofar_0 + done and not rollout.truncated[0]
    assert rollout.completion_ids[1] == (sofar_1 + done)[:limit] and rollout.truncated[1]
    assert len(rollout.tool_mask[1]) == len(rollout.sampler_logprobs[1]) == limit

    # the tool turn itself runs past the limit: cut there, truncated, nothing more generated
    limit = len(sofar_0) - 3
    gen = ScriptedGenerator(tok, lambda prompt_text, k: short)
    rollout, stats = run_tool_turns(gen, tok, [prompt], [1], SamplingConfig(max_tokens=limit), [3], runner, 2)
    assert rollout.completion_ids[0] == sofar_0[:limit] and rollout.truncated == [True]
    assert rollout.tool_mask[0] == [1] * len(ids(tok, short) + [eos]) + [0] * (limit - len(ids(tok, short)) - 1)
    assert len(gen.calls) == 1 and stats.calls == 1
    assert [m["role"] for m in rollout.messages[0]] == ["assistant"]  # the cut tool turn is not a message

    # a turn cut by max_tokens is not parsed for calls, even when its call text is complete
    limit = len(ids(tok, short))  # everything but the eos
    gen = ScriptedGenerator(tok, lambda prompt_text, k: short)
    rollout, stats = run_tool_turns(gen, tok, [prompt], [1], SamplingConfig(max_tokens=limit), [3], runner, 2)
    assert rollout.completion_ids[0] == ids(tok, short) and rollout.truncated == [True]
    assert stats.calls == 0 and len(gen.calls) == 1


def test_tensors_without_tool_mask_are_unchanged():
    r = Rollout([[1, 2], [3]], [[4, 5, 6], [7]], [[-0.1, -0.2, -0.3], [-0.4]], [False, True])
    t = r.tensors(pad_id=0)
    assert t["completion_mask"].tolist() == [[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]]
    assert t["input_ids"].tolist() == [[1, 2, 4, 5, 6], [0, 3, 7, 0, 0]]
    assert torch.equal(t["attention_mask"], torch.tensor([[1, 1, 1, 1, 1], [0, 1, 1, 0, 0]]))
