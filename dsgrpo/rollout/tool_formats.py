"""How each model family writes tool calls, and how they are read back out of a sampled turn.

A family's chat template decides both what the model is shown and what it learned to write, so the format is chosen
from the tokenizer: transformers' own parser where the tokenizer carries one (`response_template` /
`response_schema`, read by `tokenizer.parse_response`), else by the template's markers:

    hermes    Qwen2.5, Qwen3 (thinking), Hermes, most ChatML tool templates:
              <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>   (several blocks: parallel calls)
    llama3    Llama 3.1 / 3.2 / 3.3: a JSON object {"name": ..., "parameters": {...}} as the whole reply, optionally
              after <|python_tag|>; several separated by ';' or new lines
    mistral   Mistral / Mixtral: [TOOL_CALLS] followed by a JSON list of {"name", "arguments"} (v3), or by
              name[ARGS]{...} per call (v11+)

A thinking model's `<think>...</think>` is not part of the answer: calls are read after its last `</think>` (a turn
that never closed its thought made none). A call that cannot be read (malformed JSON, no name, arguments that are not
an object) becomes a ToolCall with `error`: the model is told, the metrics count it, the run goes on.

Nothing here imports vLLM or DeepSpeed; transformers only through the tokenizer it is given."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

THINK_END = "</think>"


@dataclass
class ToolCall:
    """One parsed call. `error` is set (and the call is not run) when the block could not be read."""

    name: Optional[str]
    arguments: Dict[str, Any]
    error: Optional[str] = None


def answer_part(text: str) -> str:
    """The part of a turn that can call tools: after a thinking model's last </think>; nothing while a <think> is
    still open."""
    if THINK_END in text:
        return text.rsplit(THINK_END, 1)[1]
    if "<think>" in text:
        return ""
    return text


def call_from_object(obj: Any, example: str, arguments_key: str = "arguments") -> ToolCall:
    """A ToolCall from a decoded JSON object {"name": ..., "<arguments_key>": {...}}, or one that says what is wrong."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCall(None, {}, f'the tool call has no "name" string. Write calls as {example}')
    arguments = obj.get(arguments_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(arguments, str):  # some models emit the arguments as a JSON string (OpenAI's wire format)
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        return ToolCall(
            obj["name"],
            {},
            f'the "{arguments_key}" of {obj["name"]!r} must be a JSON object, got {json.dumps(arguments)}.',
        )
    return ToolCall(obj["name"], arguments)


def _json_call(body: str, example: str, arguments_key: str = "arguments") -> ToolCall:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return ToolCall(None, {}, f"the tool call is not valid JSON ({e}). Write calls as {example}")
    return call_from_object(obj, example, arguments_key)


class ToolCallFormat:
    """A family's way of writing calls: `parse(text)` reads every call of a sampled turn in order (never raises),
    `content(text)` is the turn without its calls (what reward functions see as the message's content). `prefix`:
    the text before the turn (the prompt and earlier turns), which a template-driven parser needs."""

    name = "base"
    example = ""
    needs_prefix = False

    def parse(self, text: str, prefix: str = "") -> List[ToolCall]:
        raise NotImplementedError

    def content(self, text: str, prefix: str = "") -> str:
        raise NotImplementedError


class HermesFormat(ToolCallFormat):
    name = "hermes"
    example = '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    # an unclosed block (the model stopped inside it) reaches the end of the text and is reported as a failed call
    BLOCK = re.compile(r"<tool_call>(.*?)(</tool_call>|\Z)", re.DOTALL)

    def parse(self, text, prefix=""):
        calls = []
        for match in self.BLOCK.finditer(answer_part(text)):
            body, closed = match.group(1).strip(), bool(match.group(2))
            if not closed:
                calls.append(
                    ToolCall(None, {}, f"<tool_call> without a closing </tool_call>. Write calls as {self.example}")
                )
                continue
            calls.append(_json_call(body, self.example))
        return calls

    def content(self, text, prefix=""):
        return self.BLOCK.sub("", text).strip()


class Llama3Format(ToolCallFormat):
    """Llama 3.x's JSON tool calls: the reply is the call(s), nothing else (a reply that does not start with '{'
    after <|python_tag|> is plain text: no call)."""

    name = "llama3"
    example = '{"name": <function-name>, "parameters": <args-json-object>}'
    TAG = "<|python_tag|>"

    def _calls_text(self, text: str) -> Optional[str]:
        answer = answer_part(text)
        for end in ("<|eom_id|>", "<|eot_id|>"):
            answer = answer.replace(end, "")
        answer = answer.strip()
        if answer.startswith(self.TAG):
            answer = answer[len(self.TAG) :].strip()
        return answer if answer.startswith("{") else None

    def parse(self, text, prefix=""):
        body = self._calls_text(text)
        if body is None:
            return []
        decoder, calls, i = json.JSONDecoder(), [], 0
        while i < len(body):
            try:
                obj, end = decoder.raw_decode(body, i)
            except json.JSONDecodeError as e:
                calls.append(
                    ToolCall(None, {}, f"the tool call is not valid JSON ({e}). Write calls as {self.example}")
                )
                break
            calls.append(call_from_object(obj, self.example, arguments_key="parameters"))
            i = end
            while i < len(body) and body[i] in " \t\r\n;":
                i += 1
        return calls

    def content(self, text, prefix=""):
        return "" if self._calls_text(text) is not None else text.strip()


class MistralFormat(ToolCallFormat):
    name = "mistral"
    example = '[TOOL_CALLS][{"name": <function-name>, "arguments": <args-json-object>}]'
    MARK = "[TOOL_CALLS]"

    def parse(self, text, prefix=""):
        answer = answer_part(text).replace("</s>", "")
        if self.MARK not in answer:
            return []
        calls = []
        for part in answer.split(self.MARK)[1:]:
            part = part.strip()
            if part.startswith("["):  # v3: a JSON list of calls
                try:
                    objs, _ = json.JSONDecoder().raw_decode(part)
                except json.JSONDecodeError as e:
                    calls.append(
                        ToolCall(None, {}, f"the tool calls are not valid JSON ({e}). Write calls as {self.example}")
                    )
                    continue
                objs = objs if isinstance(objs, list) else [objs]
                calls += [call_from_object(obj, self.example) for obj in objs]
            elif "[ARGS]" in part:  # v11+: name[ARGS]{...}
                name, _, args = part.partition("[ARGS]")
                try:
                    arguments, _ = json.JSONDecoder().raw_decode(args.strip())
                    call = call_from_object({"name": name.strip(), "arguments": arguments}, self.example)
                except json.JSONDecodeError as e:
                    call = ToolCall(None, {}, f"the arguments of {name.strip()!r} are not valid JSON ({e}).")
                calls.append(call)
            else:
                calls.append(ToolCall(None, {}, f"nothing readable after {self.MARK}. Write calls as {self.example}"))
        return calls

    def content(self, text, prefix=""):
        return text.split(self.MARK, 1)[0].strip()


class TransformersFormat(ToolCallFormat):
    """The tokenizer's own parser (transformers' `parse_response`, driven by its `response_template`)."""

    name = "transformers"
    example = "the format the chat template shows"
    needs_prefix = True

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def _message(self, text, prefix):
        try:
            message = self.tokenizer.parse_response(text, prefix=prefix)
        except Exception as e:  # noqa: BLE001 - a turn the parser cannot read is the model's failure, said to it
            return None, str(e)
        return (message if isinstance(message, dict) else None), None

    def parse(self, text, prefix=""):
        message, error = self._message(text, prefix)
        if message is None:
            return (
                [ToolCall(None, {}, f"the reply could not be parsed ({error or 'no message'}).")]
                if "{" in answer_part(text)
                else []
            )
        calls = []
        for call in message.get("tool_calls") or []:
            fn = call.get("function", call) if isinstance(call, dict) else None
            calls.append(call_from_object(fn, self.example))
        return calls

    def content(self, text, prefix=""):
        message, _ = self._message(text, prefix)
        return str(message.get("content") or "") if message else text.strip()


FORMATS: Dict[str, Callable[[Any], ToolCallFormat]] = {
    "hermes": lambda tok: HermesFormat(),
    "llama3": lambda tok: Llama3Format(),
    "mistral": lambda tok: MistralFormat(),
    "transformers": TransformersFormat,
}


def _template_text(tokenizer) -> str:
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):
        template = template.get("tool_use") or template.get("default") or ""
    return template


def detect(tokenizer) -> str:
    """The format a tokenizer's chat template teaches: its own parser when it has one, else by the template's
    markers; hermes (the most common) when nothing says otherwise."""
    if getattr(tokenizer, "response_template", None) or getattr(tokenizer, "response_schema", None):
        return "transformers"
    template = _template_text(tokenizer)
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3"
    return "hermes"


def tool_call_format(tokenizer, name: Optional[str] = None) -> ToolCallFormat:
    """The named format (GRPOConfig.tool_call_format), or the one the tokenizer's template teaches (None/'auto')."""
    name = detect(tokenizer) if name in (None, "auto") else name
    if name not in FORMATS:
        raise ValueError(f"tool_call_format={name!r}: expected 'auto' or one of {sorted(FORMATS)}.")
    return FORMATS[name](tokenizer)
