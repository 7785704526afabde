"""Tool calls per model family (dsgrpo/rollout/tool_formats.py) and the token-exactness oracle of multi-turn episodes.

The oracle: an episode's trained ids (prompt + sampled turns + inserted tool turns) must equal the chat template's
rendering of the whole conversation as the reward functions see it (`apply_chat_template(messages, tools)`), for each
family's own template: parallel calls, consecutive tool messages, a failing call, a thinking model and the end-of-turn
token. Where the two legitimately differ it says so: a template renders the conversation's last reply with its
end-of-turn token and what follows it (a newline), which a finished episode ends before; and a template that drops
a thinking model's earlier thoughts would differ (Qwen3 keeps every thought after the last user message, which is
where a tool episode is). The templates are the families' own (the copies trl ships in trl/chat_templates/ for
Qwen2.5, Qwen3, Llama 3.1), Mistral's is written below from its documented format; each tokenizer is the project's
tiny one with the family's special tokens added, so a boundary between a sampled and an inserted segment is a
special token as in the real vocabularies."""

import json
import os

import pytest
from transformers import AutoTokenizer

from dsgrpo.rollout.base import Rollout, SamplingConfig
from dsgrpo.rollout.tool_formats import (
    HermesFormat,
    Llama3Format,
    MistralFormat,
    ToolCall,
    TransformersFormat,
    detect,
    tool_call_format,
)
from dsgrpo.rollout.tools import ToolRunner, run_tool_turns, tool_schemas


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


def boom(x: int) -> int:
    """Always fails.

    Args:
        x: Anything.
    """
    raise RuntimeError("boom")


TOOLS = [add, boom]


# ----------------------------------------------------------------------------------------------- parsing per family
def test_hermes_reads_parallel_calls_after_a_thought_and_reports_malformed_ones():
    fmt = HermesFormat()
    text = (
        '<think>\nmaybe <tool_call>{"name": "nope"}</tool_call>\n</think>\n\n'
        '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
        '<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 3, \\"b\\": 4}"}\n</tool_call>\n'
        '<tool_call>\n{"name": "add", "arguments": {"a": 1,}}\n</tool_call>'
    )
    good1, good2, bad = fmt.parse(text)
    assert (good1, good2) == (ToolCall("add", {"a": 1, "b": 2}), ToolCall("add", {"a": 3, "b": 4}))
    assert bad.error.startswith("the tool call is not valid JSON")
    assert fmt.parse("<think>\nstill thinking <tool_call>") == []  # an open thought calls nothing
    assert fmt.content('Sure.\n<tool_call>\n{"name": "add"}\n</tool_call>') == "Sure."


def test_llama3_reads_json_calls_with_or_without_the_python_tag():
    fmt = Llama3Format()
    assert fmt.parse('{"name": "add", "parameters": {"a": 1, "b": 2}}<|eot_id|>') == [ToolCall("add", {"a": 1, "b": 2})]
    assert fmt.parse(
        '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; '
        '{"name": "boom", "parameters": {"x": 0}}<|eom_id|>'
    ) == [ToolCall("add", {"a": 1, "b": 2}), ToolCall("boom", {"x": 0})]
    assert fmt.parse("The answer is {5}.") == []  # prose is not a call
    (bad,) = fmt.parse('{"name": "add", "parameters": {"a": }')
    assert bad.error.startswith("the tool call is not valid JSON")
    (no_name,) = fmt.parse('{"parameters": {}}')
    assert 'no "name"' in no_name.error
    assert fmt.content('{"name": "add", "parameters": {}}') == "" and fmt.content("Five.") == "Five."


def test_mistral_reads_the_list_and_the_per_call_forms():
    fmt = MistralFormat()
    assert fmt.parse(
        '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "boom", "arguments": {"x": 3}}]</s>'
    ) == [ToolCall("add", {"a": 1, "b": 2}), ToolCall("boom", {"x": 3})]
    assert fmt.parse('[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}[TOOL_CALLS]boom[ARGS]{"x": 3}') == [
        ToolCall("add", {"a": 1, "b": 2}),
        ToolCall("boom", {"x": 3}),
    ]
    (bad,) = fmt.parse('[TOOL_CALLS][{"name": "add", "arguments": {]')
    assert bad.error.startswith("the tool calls are not valid JSON")
    assert fmt.parse("No tools needed.</s>") == [] and fmt.content("Hi [TOOL_CALLS][]") == "Hi"


def test_the_tokenizers_own_parser_is_used_where_it_has_one(tmp_path):
    pytest.importorskip("trl")
    from trl.chat_template_utils import add_response_schema

    tok = family_tokenizer("qwen3")
    assert detect(tok) == "hermes"
    tok = add_response_schema(tok)  # a response_template: transformers' parse_response reads the calls
    assert detect(tok) == "transformers" and isinstance(tool_call_format(tok), TransformersFormat)
    fmt = tool_call_format(tok)
    text = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call><|im_end|>'
    assert fmt.parse(text) == [ToolCall("add", {"a": 1, "b": 2})]
    assert fmt.parse("Just text.<|im_end|>") == []
    with pytest.raises(ValueError, match="tool_call_format='xml'"):
        tool_call_format(tok, "xml")


# ----------------------------------------------------------------------------------------------- the oracle
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}{% if tools and loop.first %}[AVAILABLE_TOOLS]{{ tools | tojson }}"
    "[/AVAILABLE_TOOLS]{% endif %}[INST]{{ message['content'] }}[/INST]"
    "{% elif message['role'] == 'assistant' %}{% if message.get('tool_calls') %}[TOOL_CALLS]["
    "{% for call in message['tool_calls'] %}{\"name\": \"{{ call['function']['name'] }}\", \"arguments\": "
    "{{ call['function']['arguments'] | tojson }}}{% if not loop.last %}, {% endif %}{% endfor %}]{{ eos_token }}"
    "{% else %}{{ message['content'] }}{{ eos_token }}{% endif %}"
    "{% elif message['role'] == 'tool' %}[TOOL_RESULTS]{\"content\": {{ message['content'] | tojson }}}"
    "[/TOOL_RESULTS]{% endif %}{% endfor %}"
)

FAMILIES = {
    # name: (template, special tokens, eos, the format detect() must choose); Qwen's <tool_call> and <think> are
    # added tokens that are not special (as in Qwen's vocabularies), the others' markers are special
    "qwen2_5": ("qwen2_5.jinja", ["<|im_start|>", "<|im_end|>"], "<|im_end|>", "hermes"),
    "qwen3": ("qwen3.jinja", ["<|im_start|>", "<|im_end|>"], "<|im_end|>", "hermes"),
    "llama3_1": (
        "llama3_1.jinja",
        ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"],
        "<|eot_id|>",
        "llama3",
    ),
    "mistral": (
        MISTRAL_TEMPLATE,
        [
            "<s>",
            "</s>",
            "[INST]",
            "[/INST]",
            "[TOOL_CALLS]",
            "[AVAILABLE_TOOLS]",
            "[/AVAILABLE_TOOLS]",
            "[TOOL_RESULTS]",
            "[/TOOL_RESULTS]",
        ],
        "</s>",
        "mistral",
    ),
}


def family_tokenizer(name):
    from dsgrpo.testing import tiny_tokenizer

    template, specials, eos, _ = FAMILIES[name]
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer())
    tok.add_special_tokens({"additional_special_tokens": specials})
    if name.startswith("qwen"):
        tok.add_tokens(["<tool_call>", "</tool_call>", "<think>", "</think>", "<tool_response>", "</tool_response>"])
    tok.eos_token = eos
    if name == "mistral":
        tok.bos_token = "<s>"
    if template.endswith(".jinja"):
        import trl

        template = open(os.path.join(os.path.dirname(trl.__file__), "chat_templates", template)).read()
    tok.chat_template = template
    return tok


def call(name, args, family):
    """A call as the family's template renders it (tojson's spacing): what a model trained on it writes."""
    arguments = json.dumps(args)
    if family == "llama3_1":
        return '{"name": "' + name + '", "parameters": ' + arguments + "}"
    if family == "mistral":
        return '{"name": "' + name + '", "arguments": ' + arguments + "}"
    return '<tool_call>\n{"name": "' + name + '", "arguments": ' + arguments + "}\n</tool_call>"


def turns(family):
    """The model's turns: parallel calls with one failing (consecutive tool messages follow), a second call, the
    answer; Llama 3.1 calls one tool a turn (its template refuses more), so its calls come one per turn."""
    think = "<think>\nI should add.\n</think>\n\n" if family == "qwen3" else ""
    if family == "llama3_1":
        return [
            call("add", {"a": 2, "b": 3}, family),
            call("boom", {"x": 1}, family),
            call("add", {"a": 4, "b": 4}, family),
            "2 + 3 = 5 and 4 + 4 = 8.",
        ]
    if family == "mistral":
        return [
            "[TOOL_CALLS][" + call("add", {"a": 2, "b": 3}, family) + ", " + call("boom", {"x": 1}, family) + "]",
            "[TOOL_CALLS][" + call("add", {"a": 4, "b": 4}, family) + "]",
            "2 + 3 = 5 and 4 + 4 = 8.",
        ]
    return [
        think + call("add", {"a": 2, "b": 3}, family) + "\n" + call("boom", {"x": 1}, family),
        think + call("add", {"a": 4, "b": 4}, family),
        think + "2 + 3 = 5 and 4 + 4 = 8.",
    ]


class TurnScript:
    """Stands in for vLLM: the k-th generate call of an episode samples its k-th turn plus the family's eos."""

    def __init__(self, tok, texts):
        self.tok, self.texts, self.k = tok, texts, 0

    def generate(self, prompt_ids, counts, sampling, seeds=None):
        out = Rollout([], [], [], [])
        for p in prompt_ids:
            ids = self.tok(self.texts[self.k], add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
            out.prompt_ids.append(list(p))
            out.completion_ids.append(ids)
            out.sampler_logprobs.append([-0.5] * len(ids))
            out.truncated.append(False)
        self.k += 1
        return out


@pytest.mark.parametrize("family", list(FAMILIES))
def test_an_episode_is_token_exact_against_the_families_chat_template(family):
    tok = family_tokenizer(family)
    fmt = tool_call_format(tok)
    assert fmt.name == FAMILIES[family][3]
    user = [{"role": "user", "content": "What are 2 + 3 and 4 + 4?"}]
    schemas = tool_schemas(TOOLS)
    prompt = tok(
        tok.apply_chat_template(user, tools=schemas, tokenize=False, add_generation_prompt=True),
        add_special_tokens=False,
    )["input_ids"]
    rollout, _ = run_tool_turns(
        TurnScript(tok, turns(family)),
        tok,
        [prompt],
        [1],
        SamplingConfig(max_tokens=600),
        None,
        ToolRunner(TOOLS, 5),
        None,
        chat_template_kwargs={"tools": schemas},
        call_format=fmt,
    )
    messages = rollout.messages[0]
    tool_messages = [m for m in messages if m["role"] == "tool"]
    assert [m["content"] for m in tool_messages] == ["5", "Error: tool 'boom' raised RuntimeError: boom", "8"]
    assert sum(len(m.get("tool_calls", [])) for m in messages) == 3
    # the oracle: the whole conversation, rendered by the family's own template and tokenised at once
    rendered = tok.apply_chat_template(user + messages, tools=schemas, tokenize=False)
    trained = prompt + rollout.completion_ids[0]
    end = tok.decode(trained)
    assert rendered.startswith(end) and rendered[len(end) :] in ("", "\n"), (end, rendered)  # see the docstring
    assert trained == tok(end, add_special_tokens=False)["input_ids"]
    # the loss sees exactly the sampled turns (each ending with its eos), never a template's tokens
    sampled = [t for t, m in zip(rollout.completion_ids[0], rollout.tool_mask[0]) if m]
    expected = [
        t for text in turns(family) for t in tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    ]
    assert sampled == expected
