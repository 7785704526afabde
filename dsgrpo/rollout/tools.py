"""Tool calling during rollout (TRL's `GRPOTrainer(tools=[...])`): the model writes calls in its family's format
(rollout/tool_formats.py; Qwen2.5's by default),

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
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from .base import Generator, Rollout, SamplingConfig, round_seed
from .tool_formats import HermesFormat, ToolCall, ToolCallFormat

HERMES = HermesFormat()

# Qwen2.5's call, the default format (the others: rollout/tool_formats.py)
CALL_FORMAT = HermesFormat.example


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
                '        """'
            ) from e
        name = schema["function"]["name"]
        if name in seen:
            raise ValueError(
                f"two tools are named {name!r}; the model calls tools by name, so names must be unique. "
                "Rename one of them."
            )
        seen.add(name)
        schemas.append(schema)
    return schemas


def parse_tool_calls(text: str, call_format: Optional[ToolCallFormat] = None) -> List[ToolCall]:
    """Every tool call of a sampled turn, in order, in `call_format` (default: Qwen2.5's <tool_call> blocks).
    Never raises: a call that cannot be read becomes a ToolCall with `error`, which the model is shown."""
    return (call_format or HERMES).parse(text)


# what each completion's row of Rollout.tool_counts holds, in order (rows written before a field existed are shorter:
# the missing counts read 0)
COUNTS = ("calls", "failures", "parse_failures", "errors", "timeouts", "turns", "tool_ms", "rewrites")


@dataclass
class ToolStats:
    """Counts of one rollout, reduced over ranks as weighted means (`dist.reduce_metrics(stats.metrics(),
    stats.weights())`): calls per completion weighted by completions, failures per call weighted by calls; and
    per episode (a completion: all its turns) the calls that could not be parsed, that raised in the tool or its
    environment, that timed out, and the sampled turns; the seconds a tool call took, weighted by calls."""

    completions: int = 0
    calls: int = 0
    failures: int = 0  # calls that could not be parsed, named an unknown tool, raised or timed out
    parse_failures: int = 0
    errors: int = 0  # calls whose tool (an environment's method) raised
    timeouts: int = 0
    turns: int = 0
    tool_ms: int = 0
    rewrites: int = 0  # agent episodes whose history was rewritten (rollout/agents.py): split where it was

    @classmethod
    def of(cls, rollout: Rollout) -> "ToolStats":
        """The counts of a rollout's rows (Rollout.tool_counts): the same for a round generated at once and for
        one cut from groups generated in the background."""
        totals = [0] * len(COUNTS)
        for row in rollout.tool_counts or []:
            for k, v in enumerate(row[: len(COUNTS)]):
                totals[k] += v
        return cls(len(rollout), *totals)

    def metrics(self) -> Dict[str, float]:
        episodes = max(self.completions, 1)
        return {
            "tools/call_frequency": self.calls / episodes,
            "tools/failure_frequency": self.failures / max(self.calls, 1),
            "tools/calls_per_episode": self.calls / episodes,
            "tools/parse_failures": self.parse_failures / episodes,
            "env/errors": self.errors / episodes,
            "env/timeouts": self.timeouts / episodes,
            "env/step_s": self.tool_ms / 1000 / max(self.calls, 1),
            "episode/turns": self.turns / episodes,
            "episode/rewritten": self.rewrites / episodes,
        }

    def weights(self) -> Dict[str, float]:
        per_call = ("tools/failure_frequency", "env/step_s")
        return {k: float(self.calls if k in per_call else self.completions) for k in self.metrics()}


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
        text, kind, _ = self.call(call)
        return text, kind == "ok"

    def call(self, call: ToolCall) -> Tuple[str, str, float]:
        """(text the model sees, how it ended, seconds it ran): "ok", "parse" (the call could not be read),
        "unknown" (no such tool), "raised" (the tool raised: its message is the text) or "timeout"."""
        if call.error is not None:
            return f"Error: {call.error}", "parse", 0.0
        fn = self.tools.get(call.name)
        if fn is None:
            return (
                f"Error: unknown tool {call.name!r}. Available tools: {', '.join(sorted(self.tools))}.",
                "unknown",
                0.0,
            )
        value, kind, seconds = call_within(fn, call.arguments, self.timeout_s, f"tool-{call.name}")
        if kind == "timeout":
            return f"Error: tool {call.name!r} timed out after {self.timeout_s:g} s.", "timeout", seconds
        if kind == "raised":
            return f"Error: tool {call.name!r} raised {type(value).__name__}: {value}", "raised", seconds
        return _result_text(value), "ok", seconds


def call_within(fn: Callable, kwargs: dict, timeout_s: float, name: str) -> Tuple[Any, str, float]:
    """(its value or the exception it raised, how it ended: "ok", "raised" or "timeout", seconds) of `fn(**kwargs)`
    run in a daemon thread for at most `timeout_s` (an `async def` is awaited). A thread still running when the
    time is up is abandoned: Python cannot kill it, so it keeps what it holds until it returns or the process
    exits, but the caller goes on."""
    outcome: Dict[str, Any] = {}

    def target():
        try:
            value = fn(**kwargs)
            outcome["value"] = asyncio.run(value) if inspect.iscoroutine(value) else value
        except BaseException as e:  # noqa: BLE001 - anything the call raises is the caller's to report
            outcome["error"] = e

    start = time.perf_counter()
    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    thread.join(timeout_s)
    seconds = time.perf_counter() - start
    if thread.is_alive():
        return None, "timeout", seconds
    if "error" in outcome:
        return outcome["error"], "raised", seconds
    return outcome["value"], "ok", seconds


def _result_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(value)


def assistant_message(text: str, call_format: Optional[ToolCallFormat] = None, prefix: str = "") -> dict:
    """A sampled turn as TRL hands it to reward functions: its text without the tool calls, and the calls that could
    be read (name and arguments) under "tool_calls"."""
    call_format = call_format or HERMES
    message = {"role": "assistant", "content": call_format.content(text, prefix)}
    calls = [c for c in call_format.parse(text, prefix) if c.error is None]
    if calls:
        message["tool_calls"] = [
            {"type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls
        ]
    return message


# Stand-in content of the assistant turn when rendering a tool turn: the text after it is what the template puts
# between the end of the assistant's reply and the next reply. Plain letters, so no template strips or escapes it.
_REPLY_MARKER = "DSGRPOREPLYMARKER"


def tool_result_ids(
    tokenizer, results: Sequence[Tuple[Optional[str], str]], chat_template_kwargs: Optional[dict] = None
) -> List[int]:
    """Tokens that follow an assistant reply that made tool calls: the end of that turn, the tool turn holding
    each (tool name, result text) and the header of the next assistant turn, as the tokenizer's chat template
    renders them (ChatML: `<|im_end|>\\n<|im_start|>user\\n<tool_response>\\n...\\n</tool_response><|im_end|>\\n
    <|im_start|>assistant\\n`)."""
    return ids_after_reply(
        tokenizer,
        [{"role": "tool", "name": name or "unknown", "content": text} for name, text in results],
        chat_template_kwargs,
    )


def ids_after_reply(tokenizer, messages: Sequence[dict], chat_template_kwargs: Optional[dict] = None) -> List[int]:
    """Tokens that follow an assistant reply when `messages` (tool results, a user's next message) come after it:
    the end of that turn, the messages and the header of the next assistant turn, as the chat template renders
    them."""
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _REPLY_MARKER}, *messages]
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, **(chat_template_kwargs or {})
    )
    if text.count(_REPLY_MARKER) != 1:
        raise ValueError(
            "the chat template does not render an assistant message's content verbatim, so the tool "
            "turn that follows a reply cannot be cut out of it. Use a chat template that renders "
            "assistant content as is (Qwen2.5 / ChatML style)."
        )
    suffix = text[text.index(_REPLY_MARKER) + len(_REPLY_MARKER) :]
    # templates write their own special tokens, so no BOS/EOS is added here
    return tokenizer(suffix, add_special_tokens=False)["input_ids"]


@dataclass
class Episode:
    """One completion being built: sampled segments and tool turns, in order. Defaults on every field so that a
    completion that keeps more state (partial rollouts' `partial.Completion`, which continues across rounds) can be
    one."""

    prompt: List[int] = field(default_factory=list)
    tokens: List[int] = field(default_factory=list)
    logprobs: List[float] = field(default_factory=list)
    mask: List[int] = field(default_factory=list)
    truncated: bool = False
    turn_start: int = 0  # where the latest sampled segment begins: only its tool calls are still unanswered
    calls: int = 0
    failures: int = 0
    counts: Dict[str, float] = field(default_factory=dict)  # parse failures, errors, timeouts, tool seconds
    turns: int = 1
    messages: List[dict] = field(default_factory=list)  # the conversation so far, for the reward functions
    routes: Any = None  # a MoE sampler's experts of prompt + tokens so far ([tokens, layers, k]; see take_routes)

    def append(self, ids: List[int], logprobs: Optional[List[float]] = None) -> None:
        """Sampled tokens with their log-probs, or (logprobs None) inserted tokens outside the loss."""
        self.tokens += ids
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        self.mask += [1 if logprobs is not None else 0] * len(ids)

    def cut(self, n: int) -> None:
        del self.tokens[n:], self.logprobs[n:], self.mask[n:]

    def take_routes(self, routes) -> None:
        """The routes of a generate call over prompt + tokens so far (and its new tokens). A position keeps the route
        of the first call that reported one: that call's routing produced the log-probs of the tokens it sampled,
        and a continuation re-reads earlier positions in its prefill. The continuation adds the tool turn's
        positions and the last sampled token's, which its own call never fed back."""
        if routes is None or self.routes is None:
            self.routes = routes if self.routes is None and not self.tokens else None
            return
        merged = routes.clone()
        old = self.routes[: len(merged)]
        known = (old >= 0).all(dim=-1)
        merged[: len(old)][known] = old[known]
        self.routes = merged

    def close_turn(self, tokenizer, call_format: ToolCallFormat) -> None:
        """The latest sampled segment becomes an assistant message of the conversation."""
        # decoded whole: some families' call markers are special tokens (Mistral's [TOOL_CALLS], Llama's
        # <|python_tag|>); the special tokens left in the content (its end of turn) are then dropped
        text = tokenizer.decode(self.tokens[self.turn_start :], skip_special_tokens=False)
        message = assistant_message(text, call_format, self.prefix(tokenizer, call_format))
        for token in tokenizer.all_special_tokens:
            message["content"] = message["content"].replace(token, "")
        message["content"] = message["content"].strip()
        self.messages.append(message)

    def close_last_turn(self, tokenizer, call_format: ToolCallFormat) -> None:
        """The episode ended: its last sampled turn (or its only one) joins the conversation."""
        if self.tokens[self.turn_start :] or not self.messages:
            self.close_turn(tokenizer, call_format)

    def prefix(self, tokenizer, call_format: ToolCallFormat) -> str:
        """What came before the latest turn, for parsers that read it (the tokenizer's own: tool_formats.py)."""
        if not call_format.needs_prefix:
            return ""
        return tokenizer.decode(self.prompt + self.tokens[: self.turn_start], skip_special_tokens=False)

    def answer_calls(
        self,
        runner: "ToolRunner",
        tokenizer,
        call_format: ToolCallFormat,
        limit: int,
        chat_template_kwargs: Optional[dict] = None,
    ) -> bool:
        """Run the tool calls of the latest sampled turn and append the tool turn (outside the loss). True when a
        continuation is to be sampled; False when the turn made no call, or the tool turn left no room under
        `limit` tokens (it is then cut and the episode truncated)."""
        if self.truncated:
            return False
        calls = call_format.parse(
            tokenizer.decode(self.tokens[self.turn_start :], skip_special_tokens=False),
            self.prefix(tokenizer, call_format),
        )
        if not calls:
            return False
        outcomes = [runner.call(call) for call in calls]
        results = [(text, kind == "ok") for text, kind, _ in outcomes]
        self.calls += len(calls)
        self.failures += sum(not ok for _, ok in results)
        for _, kind, seconds in outcomes:
            self.counts[kind] = self.counts.get(kind, 0) + 1
            self.counts["seconds"] = self.counts.get("seconds", 0.0) + seconds
        turn = tool_result_ids(
            tokenizer, [(c.name, text) for c, (text, _) in zip(calls, results)], chat_template_kwargs
        )
        if self.tokens and turn and self.tokens[-1] == turn[0] and turn[0] in set(tokenizer.all_special_ids):
            turn = turn[1:]  # the model already sampled the end-of-turn token (its eos) the template starts with
        self.close_turn(tokenizer, call_format)
        self.append(turn)
        self.turn_start = len(self.tokens)
        if len(self.tokens) >= limit:  # no room left to answer: the tool turn is cut, not part of the conversation
            self.cut(limit)
            self.truncated = True
            return False
        self.messages += [
            {"role": "tool", "name": c.name or "unknown", "content": text} for c, (text, _) in zip(calls, results)
        ]
        return True

    def tool_counts(self) -> List[int]:
        """The episode's row of Rollout.tool_counts, in COUNTS' order."""
        c = self.counts
        return [
            self.calls,
            self.failures,
            int(c.get("parse", 0)),
            int(c.get("raised", 0)),
            int(c.get("timeout", 0)),
            self.turns,
            int(round(c.get("seconds", 0.0) * 1000)),
        ]

    def restart_turns(self) -> None:
        """Forget everything sampled and answered (the prompt stays)."""
        self.tokens, self.logprobs, self.mask, self.messages, self.counts = [], [], [], [], {}
        self.truncated, self.turn_start, self.calls, self.failures, self.turns, self.routes = False, 0, 0, 0, 1, None


class SegmentTurns:
    """Tool turns for a source that steps the engine one request at a time (partial rollouts, rollout/partial.py):
    `open` an episode for a dataset row, `after_segment` when one of its sampled segments ends (its calls are
    answered and a continuation is due, or the episode is over). `stateful`: episodes act on environments, which a
    checkpoint cannot hold (a resumed run re-runs them from reset)."""

    stateful = False

    def __init__(
        self,
        prompts,
        tokenizer,
        call_format: ToolCallFormat,
        max_iterations: Optional[int],
        runner: Optional["ToolRunner"] = None,
        chat_template_kwargs: Optional[dict] = None,
    ):
        self.prompts, self.tokenizer, self.call_format = prompts, tokenizer, call_format or HERMES
        self.max_iterations, self.runner = max_iterations, runner
        self.chat_template_kwargs = (
            chat_template_kwargs if chat_template_kwargs is not None else prompts.chat_template_kwargs
        )

    def open(self, index: int, instance: Any = None) -> Tuple[List[int], "ToolRunner", Any]:
        """(prompt ids, the runner its calls go to, its environment or None) of a new episode of dataset row
        `index`; `instance`: an environment to reset again (an episode sampled again from the start)."""
        return list(self.prompts.prompt_ids[index]), self.runner, None

    def start_failure(self, instance: Any) -> Optional[str]:
        """How opening the episode of `instance` failed ("raised", "timeout": counted as its errors), or None."""
        return None

    def after_segment(self, episode: Episode, runner: "ToolRunner", limit: int) -> bool:
        """A sampled segment ended (its own stop or max tokens, not a round's cut). True when the episode goes on:
        its calls were answered and a continuation is to be sampled; else its last turn is closed."""
        answered = episode.turns - 1
        if (self.max_iterations is None or answered < self.max_iterations) and episode.answer_calls(
            runner, self.tokenizer, self.call_format, limit, self.chat_template_kwargs
        ):
            episode.turns += 1
            return True
        episode.close_last_turn(self.tokenizer, self.call_format)
        return False

    def handed(self, instances: List[Any]) -> None:
        """The environments of a batch about to be scored (environments keep them as the trainer's `environments`)."""


def _routes_of(row: Episode):
    """A finished row's routes, one per token kept: cut at a row's room, and -1 (the trainer routes) for a tool turn
    that was cut at max_tokens, which no call ever read."""
    n = len(row.prompt) + len(row.tokens)
    routes = row.routes[:n]
    if len(routes) < n:
        routes = routes.new_full((n, *routes.shape[1:]), -1)
        routes[: len(row.routes)] = row.routes
    return routes


def run_tool_turns(
    generator: Generator,
    tokenizer,
    prompt_ids: List[List[int]],
    counts: List[int],
    sampling: SamplingConfig,
    seeds: Optional[List[int]],
    runner: Union[ToolRunner, Sequence[ToolRunner]],
    max_tool_calling_iterations: Optional[int],
    *,
    chat_template_kwargs: Optional[dict] = None,
    call_format: Optional[ToolCallFormat] = None,
    lockstep: Optional[Callable[[bool], bool]] = None,
) -> Tuple[Rollout, ToolStats]:
    """Generate counts[j] completions for prompt j (as `generator.generate`), answering tool calls.

    Each iteration takes the completions whose latest turn ended (not truncated) with tool calls, runs the calls,
    appends the tool turn (`tool_result_ids`) and samples one continuation per completion from prompt + everything
    so far. `max_tool_calling_iterations` bounds the iterations (None: until no completion calls a tool); a turn
    that calls tools after the last iteration stays unanswered. The whole completion, tool turns included, is held
    to `sampling.max_tokens`: what goes past it is cut and the completion marked truncated.

    `runner`: one for every row, or one per row (each rollout's environment: rollout/environments.py).
    `call_format`: how the model writes calls (rollout/tool_formats.py; default Qwen2.5's <tool_call> blocks).
    `lockstep`: for an engine whose ranks must make the same calls (tensor-parallel vLLM): given whether this rank
    has rows to continue, whether any rank of the engine has; a rank with none then joins the call with no rows.

    Returns the Rollout (rows prompt by prompt as in `generate`, with `tool_mask`) and this call's ToolStats.
    Continuations are seeded from (seeds[j], iteration, position in the group), so a rerun samples the same."""
    if max_tool_calling_iterations is not None and max_tool_calling_iterations < 0:
        raise ValueError(
            f"max_tool_calling_iterations={max_tool_calling_iterations}: use a count >= 0, or None for no limit."
        )
    call_format = call_format or HERMES
    first = generator.generate(prompt_ids, counts, sampling, seeds=seeds)
    runners = [runner] * len(first) if isinstance(runner, ToolRunner) else list(runner)
    if len(runners) != len(first):
        raise ValueError(f"{len(runners)} tool runners for {len(first)} completions: give one, or one per completion.")
    rows = [Episode(list(first.prompt_ids[i]), truncated=first.truncated[i]) for i in range(len(first))]
    for i, (row, ids, logprobs) in enumerate(zip(rows, first.completion_ids, first.sampler_logprobs)):
        row.take_routes(None if first.routes is None else first.routes[i])
        row.append(list(ids), list(logprobs))
    # (prompt, position in its group) of each row, for the continuation seeds
    origin = [(j, k) for j, n in enumerate(counts) for k in range(n)]
    limit = sampling.max_tokens
    candidates = list(range(len(rows)))
    iteration = 0
    while (candidates or lockstep) and (max_tool_calling_iterations is None or iteration < max_tool_calling_iterations):
        iteration += 1
        # ---- run the calls of every completion whose latest turn made some; append the tool turns
        continuing = [
            i
            for i in candidates
            if rows[i].answer_calls(runners[i], tokenizer, call_format, limit, chat_template_kwargs)
        ]
        if not (lockstep(bool(continuing)) if lockstep else continuing):
            break
        # ---- one continuation each, in one call. The call's max_tokens is the largest room left; each row is then
        # cut to its own room (sampling stops at max_tokens, so the kept tokens are what a shorter limit samples;
        # a row whose prompt + max_tokens passes vLLM's max_model_len just stops there, past its own cut)
        room = [limit - len(rows[i].tokens) for i in continuing]
        cont_seeds = (
            None if seeds is None else [round_seed(seeds[origin[i][0]], iteration, origin[i][1]) for i in continuing]
        )
        more = generator.generate(
            [rows[i].prompt + rows[i].tokens for i in continuing],
            [1] * len(continuing),
            replace(sampling, max_tokens=max(room, default=1)),
            seeds=cont_seeds,
        )
        for n, i in enumerate(continuing):
            row, ids, logprobs = rows[i], list(more.completion_ids[n]), list(more.sampler_logprobs[n])
            row.take_routes(None if more.routes is None else more.routes[n])
            row.turn_start = len(row.tokens)
            row.truncated = more.truncated[n] or len(ids) > room[n]
            row.append(ids[: room[n]], logprobs[: room[n]])
            row.turns += 1
        candidates = continuing
    for row in rows:
        row.close_last_turn(tokenizer, call_format)
    rollout = Rollout(
        [r.prompt for r in rows],
        [r.tokens for r in rows],
        [r.logprobs for r in rows],
        [r.truncated for r in rows],
        tool_mask=[r.mask for r in rows],
        messages=[r.messages for r in rows],
        tool_counts=[r.tool_counts() for r in rows],
    )
    if rows and all(r.routes is not None for r in rows):
        rollout.routes = [_routes_of(r) for r in rows]
    return rollout, ToolStats.of(rollout)
