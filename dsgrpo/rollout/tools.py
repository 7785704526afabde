"""Tool calling during rollout (TRL's `GRPOTrainer(tools=[...])`): the model writes Qwen2.5-style calls,

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "2 + 3"}}
    </tool_call>

the trainer runs them, appends the results as the chat template's tool turn and lets the model continue. The
completion that is trained on holds the sampled tokens and the inserted tool-result tokens in order; the
inserted ones carry `Rollout.tool_mask` 0, so they are context for the forward pass but not part of the loss.

Nothing here imports vLLM or DeepSpeed: the generator is any `Generator` (a stub in the unit tests).
The prompt must list the tools: render it with `apply_chat_template(..., tools=tool_schemas(tools))`."""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import threading
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from .base import Generator, Rollout, SamplingConfig, round_seed

# Qwen2.5's wrapper. An unclosed block (the model stopped inside it) reaches the end of the text and is
# reported to the model as a failed call.
TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)(</tool_call>|\Z)", re.DOTALL)
CALL_FORMAT = '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'


def tool_schemas(tools: Sequence[Callable]) -> List[dict]:
    """The JSON schema of each tool (what the chat template shows the model), from its type hints and its
    Google-style docstring. Raises ValueError for a tool that cannot be described or a repeated name."""
    from transformers.utils import get_json_schema

    schemas, seen = [], set()
    for fn in tools:
        name = getattr(fn, "__name__", repr(fn))
        if not callable(fn):
            raise ValueError(f"tools must be functions; got {fn!r} ({type(fn).__name__}).")
        try:
            schema = get_json_schema(fn)
        except Exception as e:  # transformers' DocstringParsingException / TypeHintParsingException
            raise ValueError(
                f"tool {name!r} cannot be described to the model: {e}. Give every argument a type hint and write a "
                "docstring with a one-line description and an 'Args:' section naming each argument, e.g.\n"
                "    def calculator(expression: str) -> str:\n"
                '        """Evaluate an arithmetic expression.\n\n'
                "        Args:\n"
                '            expression: The expression, e.g. "2 + 3".\n'
                '        """') from e
        name = schema["function"]["name"]
        if name in seen:
            raise ValueError(f"two tools are named {name!r}; the model calls tools by name, so names must be unique. "
                             "Rename one of them.")
        seen.add(name)
        schemas.append(schema)
    return schemas


@dataclass
class ToolCall:
    """One parsed call. `error` is set (and the call is not run) when the block could not be read."""
    name: Optional[str]
    arguments: Dict[str, Any]
    error: Optional[str] = None


def parse_tool_calls(text: str) -> List[ToolCall]:
    """Every <tool_call> block of `text`, in order. Never raises: a block that is not valid JSON, lacks a name or
    has non-object arguments becomes a ToolCall with `error`, which the model is shown as the tool's result."""
    calls = []
    for match in TOOL_CALL_RE.finditer(text):
        body, closed = match.group(1).strip(), bool(match.group(2))
        if not closed:
            error = f"<tool_call> without a closing </tool_call>. Write calls as {CALL_FORMAT}"
            calls.append(ToolCall(None, {}, error))
            continue
        calls.append(_parse_call_body(body))
    return calls


def _parse_call_body(body: str) -> ToolCall:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return ToolCall(None, {}, f"the tool call is not valid JSON ({e}). Write calls as {CALL_FORMAT}")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCall(None, {}, f"the tool call has no \"name\" string. Write calls as {CALL_FORMAT}")
    arguments = obj.get("arguments", {})
    if isinstance(arguments, str):  # some models emit the arguments as a JSON string (OpenAI's wire format)
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        return ToolCall(obj["name"], {}, f"the \"arguments\" of {obj['name']!r} must be a JSON object, got "
                                         f"{json.dumps(arguments)}.")
    return ToolCall(obj["name"], arguments)


@dataclass
class ToolStats:
    """Counts of one rollout, reduced over ranks as weighted means (`dist.reduce_metrics(stats.metrics(),
    stats.weights())`): calls per completion weighted by completions, failures per call weighted by calls."""
    completions: int = 0
    calls: int = 0
    failures: int = 0   # calls that could not be parsed, named an unknown tool, raised or timed out

    @classmethod
    def of(cls, rollout: Rollout) -> "ToolStats":
        """The counts of a rollout's rows (Rollout.tool_counts): the same for a round generated at once and for
        one cut from groups generated in the background."""
        counts = rollout.tool_counts or []
        return cls(len(rollout), sum(c for c, _ in counts), sum(f for _, f in counts))

    def metrics(self) -> Dict[str, float]:
        return {"tools/call_frequency": self.calls / max(self.completions, 1),
                "tools/failure_frequency": self.failures / max(self.calls, 1)}

    def weights(self) -> Dict[str, float]:
        return {"tools/call_frequency": float(self.completions), "tools/failure_frequency": float(self.calls)}


class ToolRunner:
    """Runs tool calls by name, each within `timeout_s` seconds.

    A call runs in a daemon thread that is abandoned when the time is up: Python cannot kill a thread, so a hung
    tool keeps its thread (and whatever it holds) until it returns or the process exits, but the rollout goes on.
    Calls run one after another, so tools need not be thread-safe. `async def` tools are awaited."""

    def __init__(self, tools: Sequence[Callable], timeout_s: float, schemas: Optional[List[dict]] = None):
        if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
            raise ValueError(f"timeout_s={timeout_s!r}: a tool's time limit must be a positive number of seconds.")
        # fails here, before any generation, for an undescribable tool; `schemas`: already described (an
        # environment's methods, bound to each rollout's instance, are described once from a probe)
        self.schemas = schemas if schemas is not None else tool_schemas(tools)
        self.tools = {schema["function"]["name"]: fn for schema, fn in zip(self.schemas, tools)}
        self.timeout_s = timeout_s

    def run(self, call: ToolCall) -> Tuple[str, bool]:
        """(text the model sees, ok). Every failure becomes an 'Error: ...' text instead of an exception."""
        if call.error is not None:
            return f"Error: {call.error}", False
        fn = self.tools.get(call.name)
        if fn is None:
            return f"Error: unknown tool {call.name!r}. Available tools: {', '.join(sorted(self.tools))}.", False
        outcome: Dict[str, Any] = {}

        def target():
            try:
                value = fn(**call.arguments)
                outcome["value"] = asyncio.run(value) if inspect.iscoroutine(value) else value
            except BaseException as e:  # noqa: BLE001 - anything a tool raises is reported to the model
                outcome["error"] = e

        thread = threading.Thread(target=target, name=f"tool-{call.name}", daemon=True)
        thread.start()
        thread.join(self.timeout_s)
        if thread.is_alive():
            return f"Error: tool {call.name!r} timed out after {self.timeout_s:g} s.", False
        if "error" in outcome:
            e = outcome["error"]
            return f"Error: tool {call.name!r} raised {type(e).__name__}: {e}", False
        return _result_text(outcome["value"]), True


def _result_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(value)


def assistant_message(text: str) -> dict:
    """A sampled turn as TRL hands it to reward functions: its text without the tool-call blocks, and the calls
    that could be read (name and arguments) under "tool_calls"."""
    message = {"role": "assistant", "content": TOOL_CALL_RE.sub("", text).strip()}
    calls = [c for c in parse_tool_calls(text) if c.error is None]
    if calls:
        message["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                 for c in calls]
    return message


# Stand-in content of the assistant turn when rendering a tool turn: the text after it is what the template puts
# between the end of the assistant's reply and the next reply. Plain letters, so no template strips or escapes it.
_REPLY_MARKER = "DSGRPOREPLYMARKER"


def tool_result_ids(tokenizer, results: Sequence[Tuple[Optional[str], str]],
                    chat_template_kwargs: Optional[dict] = None) -> List[int]:
    """Tokens that follow an assistant reply that made tool calls: the end of that turn, the tool turn holding
    each (tool name, result text) and the header of the next assistant turn, as the tokenizer's chat template
    renders them (ChatML: `<|im_end|>\\n<|im_start|>user\\n<tool_response>\\n...\\n</tool_response><|im_end|>\\n
    <|im_start|>assistant\\n`)."""
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _REPLY_MARKER}]
    messages += [{"role": "tool", "name": name or "unknown", "content": text} for name, text in results]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                         **(chat_template_kwargs or {}))
    if text.count(_REPLY_MARKER) != 1:
        raise ValueError("the chat template does not render an assistant message's content verbatim, so the tool "
                         "turn that follows a reply cannot be cut out of it. Use a chat template that renders "
                         "assistant content as is (Qwen2.5 / ChatML style).")
    suffix = text[text.index(_REPLY_MARKER) + len(_REPLY_MARKER):]
    # templates write their own special tokens, so no BOS/EOS is added here
    return tokenizer(suffix, add_special_tokens=False)["input_ids"]


@dataclass
class _Row:
    """One completion being built: sampled segments and tool turns, in order."""
    prompt: List[int]
    ids: List[int]
    logprobs: List[float]
    mask: List[int]
    truncated: bool
    turn_start: int = 0   # where the latest sampled segment begins: only its tool calls are still unanswered
    calls: int = 0
    failures: int = 0
    messages: List[dict] = field(default_factory=list)  # the conversation so far, for the reward functions
    routes: Any = None    # a MoE sampler's experts of prompt + ids so far ([tokens, layers, k]; see take_routes)

    def append(self, ids: List[int], logprobs: Optional[List[float]] = None) -> None:
        """Sampled tokens with their log-probs, or (logprobs None) inserted tokens outside the loss."""
        self.ids += ids
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        self.mask += [1 if logprobs is not None else 0] * len(ids)

    def cut(self, n: int) -> None:
        del self.ids[n:], self.logprobs[n:], self.mask[n:]

    def take_routes(self, routes) -> None:
        """The routes of a generate call over prompt + ids so far (and its new tokens). A position keeps the route
        of the first call that reported one: that call's routing produced the log-probs of the tokens it sampled,
        and a continuation re-reads earlier positions in its prefill. The continuation adds the tool turn's
        positions and the last sampled token's, which its own call never fed back."""
        if routes is None or self.routes is None:
            self.routes = routes if self.routes is None and not self.ids else None
            return
        merged = routes.clone()
        old = self.routes[:len(merged)]
        known = (old >= 0).all(dim=-1)
        merged[:len(old)][known] = old[known]
        self.routes = merged

    def close_turn(self, tokenizer) -> None:
        """The latest sampled segment becomes an assistant message of the conversation."""
        self.messages.append(assistant_message(tokenizer.decode(self.ids[self.turn_start:], skip_special_tokens=True)))


def _routes_of(row: _Row):
    """A finished row's routes, one per token kept: cut at a row's room, and -1 (the trainer routes) for a tool turn
    that was cut at max_tokens, which no call ever read."""
    n = len(row.prompt) + len(row.ids)
    routes = row.routes[:n]
    if len(routes) < n:
        routes = routes.new_full((n, *routes.shape[1:]), -1)
        routes[:len(row.routes)] = row.routes
    return routes


def run_tool_turns(generator: Generator, tokenizer, prompt_ids: List[List[int]], counts: List[int],
                   sampling: SamplingConfig, seeds: Optional[List[int]],
                   runner: Union[ToolRunner, Sequence[ToolRunner]],
                   max_tool_calling_iterations: Optional[int], *,
                   chat_template_kwargs: Optional[dict] = None) -> Tuple[Rollout, ToolStats]:
    """Generate counts[j] completions for prompt j (as `generator.generate`), answering tool calls.

    Each iteration takes the completions whose latest turn ended (not truncated) with tool calls, runs the calls,
    appends the tool turn (`tool_result_ids`) and samples one continuation per completion from prompt + everything
    so far. `max_tool_calling_iterations` bounds the iterations (None: until no completion calls a tool); a turn
    that calls tools after the last iteration stays unanswered. The whole completion, tool turns included, is held
    to `sampling.max_tokens`: what goes past it is cut and the completion marked truncated.

    `runner`: one for every row, or one per row (each rollout's environment: rollout/environments.py).

    Returns the Rollout (rows prompt by prompt as in `generate`, with `tool_mask`) and this call's ToolStats.
    Continuations are seeded from (seeds[j], iteration, position in the group), so a rerun samples the same."""
    if max_tool_calling_iterations is not None and max_tool_calling_iterations < 0:
        raise ValueError(f"max_tool_calling_iterations={max_tool_calling_iterations}: use a count >= 0, or None "
                         "for no limit.")
    first = generator.generate(prompt_ids, counts, sampling, seeds=seeds)
    runners = [runner] * len(first) if isinstance(runner, ToolRunner) else list(runner)
    if len(runners) != len(first):
        raise ValueError(f"{len(runners)} tool runners for {len(first)} completions: give one, or one per completion.")
    rows = [_Row(list(first.prompt_ids[i]), [], [], [], first.truncated[i]) for i in range(len(first))]
    for i, (row, ids, logprobs) in enumerate(zip(rows, first.completion_ids, first.sampler_logprobs)):
        row.take_routes(None if first.routes is None else first.routes[i])
        row.append(list(ids), list(logprobs))
    # (prompt, position in its group) of each row, for the continuation seeds
    origin = [(j, k) for j, n in enumerate(counts) for k in range(n)]
    special = set(tokenizer.all_special_ids)
    limit = sampling.max_tokens
    candidates = list(range(len(rows)))
    iteration = 0
    while candidates and (max_tool_calling_iterations is None or iteration < max_tool_calling_iterations):
        iteration += 1
        # ---- run the calls of every completion whose latest turn made some; append the tool turns
        continuing = []
        for i in candidates:
            row = rows[i]
            if row.truncated:
                continue
            calls = parse_tool_calls(tokenizer.decode(row.ids[row.turn_start:], skip_special_tokens=False))
            if not calls:
                continue
            results = [runners[i].run(call) for call in calls]
            row.calls += len(calls)
            row.failures += sum(not ok for _, ok in results)
            turn = tool_result_ids(tokenizer, [(c.name, text) for c, (text, _) in zip(calls, results)],
                                   chat_template_kwargs)
            if row.ids and turn and row.ids[-1] == turn[0] and turn[0] in special:
                turn = turn[1:]   # the model already sampled the end-of-turn token (its eos) the template starts with
            row.close_turn(tokenizer)
            row.append(turn)
            row.turn_start = len(row.ids)
            if len(row.ids) >= limit:   # no room left to answer: the tool turn is cut, not part of the conversation
                row.cut(limit)
                row.truncated = True
                continue
            row.messages += [{"role": "tool", "name": c.name or "unknown", "content": text}
                             for c, (text, _) in zip(calls, results)]
            continuing.append(i)
        if not continuing:
            break
        # ---- one continuation each, in one call. The call's max_tokens is the largest room left; each row is then
        # cut to its own room (sampling stops at max_tokens, so the kept tokens are what a shorter limit samples;
        # a row whose prompt + max_tokens passes vLLM's max_model_len just stops there, past its own cut)
        room = [limit - len(rows[i].ids) for i in continuing]
        cont_seeds = None if seeds is None else [round_seed(seeds[origin[i][0]], iteration, origin[i][1])
                                                 for i in continuing]
        more = generator.generate([rows[i].prompt + rows[i].ids for i in continuing], [1] * len(continuing),
                                  replace(sampling, max_tokens=max(room)), seeds=cont_seeds)
        for n, i in enumerate(continuing):
            row, ids, logprobs = rows[i], list(more.completion_ids[n]), list(more.sampler_logprobs[n])
            row.take_routes(None if more.routes is None else more.routes[n])
            row.turn_start = len(row.ids)
            row.truncated = more.truncated[n] or len(ids) > room[n]
            row.append(ids[:room[n]], logprobs[:room[n]])
        candidates = continuing
    for row in rows:  # the last sampled turn (or the only one)
        if row.ids[row.turn_start:] or not row.messages:
            row.close_turn(tokenizer)
    rollout = Rollout([r.prompt for r in rows], [r.ids for r in rows], [r.logprobs for r in rows],
                      [r.truncated for r in rows], tool_mask=[r.mask for r in rows], messages=[r.messages for r in rows],
                      tool_counts=[[r.calls, r.failures] for r in rows])
    if rows and all(r.routes is not None for r in rows):
        rollout.routes = [_routes_of(r) for r in rows]
    return rollout, ToolStats.of(rollout)
