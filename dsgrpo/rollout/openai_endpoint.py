"""An OpenAI-compatible endpoint on this rank's generator, for agents that run their own loop (issue 56).

`POST /v1/chat/completions` (messages, tools, tool_choice auto/none, n, max_tokens / max_completion_tokens, stop,
seed, stream; temperature, top_p and top_k are the trainer's, whatever a request asks, as the trained log-probs
need), `POST /v1/completions` (a prompt as text or token ids), vLLM's token-in/token-out dialect that verifiers'
TrainClient speaks (`POST /inference/v1/generate`: {model, token_ids, sampling_params} in, choices[0].token_ids
and per-token logprobs out; `POST /inference/v1/abort_requests`), `GET /v1/models` (with `max_model_len`) and
`/health`, served by http.json_server: loopback by default, a token required to bind anything else, size and
connection limits, OpenAI's error shape. Every request names its episode (`episode_id` in the body, which the
openai client sends with `extra_body`, or an `X-Episode-Id` header, or verifiers' `X-Session-ID`) among those the
trainer opened; each call's prompt ids, sampled ids, log-probs and weight versions are recorded under it, and the
trainer trains exactly those (rollout/agents.py).

Token-exact by construction: when a chat request's messages are the episode's previous request's messages, then
the assistant message that request was answered with, then new messages, its prompt is the previous prompt + the
ids that were sampled + the new messages' tokens as the chat template renders them after an assistant turn
(tools.ids_after_reply) — never a re-tokenisation of the conversation. A completions request continues when its
ids start with the previous prompt + sampled ids, and so does a generate request's token_ids. Any other request
(the agent rewrote its history) starts a new chain of calls. An episode's chain holds at most
`max_completion_length` tokens after its first prompt, and when every chain trains (rollout/agents.py) its chains
hold that much together: a call is given what is left (a choice cut there finishes with "length"), and none once
it is used up; a request past the model's context (max_tokens included) is refused, as vLLM refuses it.

Calls waiting together are generated in one engine call (a few milliseconds' window), so many episodes in flight
keep the engine's batch full. A bad request gets an OpenAI-style error ({"error": {"message", "type", "param",
"code"}}) and the engine goes on.

stream=true is answered as OpenAI streams (server-sent `chat.completion.chunk` / `text_completion` events, then
`[DONE]`; `stream_options.include_usage` adds the usage chunk), but each choice arrives whole once it is generated:
an agent in a training loop waits for the whole answer anyway, and the engine generates a batch of calls at once."""

from __future__ import annotations

import json
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Tuple

import torch

from .. import compat
from ..http import EventStream, json_server, openai_error
from .base import SamplingConfig
from .tools import assistant_message, ids_after_reply

ROLES = ("system", "user", "assistant", "tool")
MAX_N = 64
BATCH_WINDOW_S = 0.005


class RequestError(ValueError):
    """A request the endpoint refuses: OpenAI's error shape, with this status."""

    def __init__(
        self,
        message: str,
        param: Optional[str] = None,
        code: Optional[str] = None,
        status: int = 400,
        kind: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.status, self.param, self.code, self.kind = status, param, code, kind

    def reply(self) -> Tuple[int, dict]:
        return self.status, openai_error(self.status, str(self), self.param, self.code, self.kind)


@dataclass
class Choice:
    ids: List[int]
    logprobs: List[float]
    versions: List[int]
    truncated: bool
    answer: Optional[dict] = None  # chat: the assistant message sent back, normalised (matched by the next call)


@dataclass
class Call:
    """One request: its prompt and the n completions it was answered with; `chosen` is the one the episode went on
    with (the next request's match; the first until one is known)."""

    prompt_ids: List[int]
    choices: List[Choice]
    extends: bool  # the prompt continues the previous call's prompt + chosen completion
    messages: Optional[List[dict]] = None  # chat: the request's messages, normalised
    chosen: int = 0

    @property
    def sampled(self) -> Choice:
        return self.choices[self.chosen]


def chains_of(calls: List[Call]) -> List[List[Call]]:
    """Calls cut where the agent rewrote its history: a chain's calls each continue the one before."""
    out: List[List[Call]] = []
    for call in calls:
        if out and call.extends:
            out[-1].append(call)
        else:
            out.append([call])
    return out


@dataclass
class Episode:
    budget: int  # tokens a chain may hold after its first prompt
    whole_episode: bool = False  # the budget holds every chain's tokens (they all train: rollout/agents.py)
    calls: List[Call] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def chain_start(self) -> int:
        """Index of the first call of the current chain."""
        k = len(self.calls) - 1
        while k > 0 and self.calls[k].extends:
            k -= 1
        return max(k, 0)

    def spent(self, extends: bool) -> int:
        """Tokens of the chains before the one a call continues (`extends`) or starts, where they count."""
        if not self.whole_episode:
            return 0
        chains = chains_of(self.calls)
        return sum(
            len(c[-1].prompt_ids) + len(c[-1].sampled.ids) - len(c[0].prompt_ids)
            for c in (chains[:-1] if extends else chains)
        )


class Episodes:
    """The episodes the trainer opened, by id (thread-safe); a request naming another id is refused."""

    def __init__(self):
        self._open: Dict[str, Episode] = {}
        self._lock = threading.Lock()

    def open(self, episode_id: str, budget: int, whole_episode: bool = False) -> None:
        with self._lock:
            self._open[episode_id] = Episode(budget, whole_episode)

    def get(self, episode_id) -> Episode:
        with self._lock:
            episode = self._open.get(str(episode_id)) if episode_id is not None else None
        if episode is None:
            raise RequestError(
                "the request names no open episode: pass the episode id the trainer gave your agent "
                "(extra_body={'episode_id': ...} or the X-Episode-Id header)",
                "episode_id",
                "unknown_episode",
                status=404 if episode_id is not None else 400,
            )
        return episode

    def close(self, episode_id: str) -> Episode:
        with self._lock:
            return self._open.pop(episode_id)


def normal_message(message, index: int) -> dict:
    """A request's message as the chat template reads it; tool call arguments sent as a JSON string (OpenAI's
    form) become the object the templates expect. Raises RequestError naming the message."""
    if not isinstance(message, dict) or message.get("role") not in ROLES:
        raise RequestError(f"messages[{index}] must be an object whose role is one of {list(ROLES)}", "messages")
    content = message.get("content")
    if isinstance(content, list):  # OpenAI's content parts: text only
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise RequestError(f"messages[{index}].content: only text parts are served", "messages")
        content = "".join(p["text"] for p in content)
    if content is not None and not isinstance(content, str):
        raise RequestError(f"messages[{index}].content must be a string, text parts or null", "messages")
    out = {"role": message["role"], "content": content or ""}
    if message.get("tool_calls"):
        calls = []
        for call in message["tool_calls"]:
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise RequestError(f"messages[{index}].tool_calls: each needs function.name", "messages")
            arguments = fn.get("arguments", {})
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments) if arguments.strip() else {}
                except ValueError:
                    raise RequestError(
                        f"messages[{index}].tool_calls: arguments of {fn['name']!r} are not JSON", "messages"
                    ) from None
            calls.append({"type": "function", "function": {"name": fn["name"], "arguments": arguments}})
        out["tool_calls"] = calls
    if message["role"] == "tool" and message.get("name"):
        out["name"] = message["name"]
    return out


def answers_a_call(messages: List[dict]) -> None:
    """A `tool` message answers a tool call: it follows an assistant message that made calls (or another tool
    message answering the same one), as OpenAI requires. RequestError naming the message otherwise."""
    for i, m in enumerate(messages):
        if m["role"] != "tool":
            continue
        k = i - 1
        while k >= 0 and messages[k]["role"] == "tool":
            k -= 1
        if k < 0 or messages[k]["role"] != "assistant" or not messages[k].get("tool_calls"):
            raise RequestError(
                f"messages[{i}]: a message with role 'tool' must be a response to a preceding assistant message "
                "with 'tool_calls'",
                "messages",
            )


def _answer_matches(sent: Optional[dict], given: dict) -> bool:
    """The assistant message a request repeats is the one it was answered with (content and calls)."""
    if sent is None or given.get("role") != "assistant":
        return False
    calls = lambda m: [(c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls", [])]  # noqa: E731
    return sent["content"].strip() == given["content"].strip() and calls(sent) == calls(given)


class OpenAIEndpoint:
    """The endpoint and its engine thread. `url` is the base an OpenAI client takes; `episodes` the open ones."""

    def __init__(
        self,
        generator,
        tokenizer,
        sampling: SamplingConfig,
        *,
        call_format,
        max_model_len: Optional[int],
        model_name: str = "policy",
        host: str = "127.0.0.1",
        port: int = 0,
        token: Optional[str] = None,
        max_request_bytes: int = 16 * 2**20,
        chat_template_kwargs: Optional[dict] = None,
    ):
        self.generator, self.tokenizer, self.sampling = generator, tokenizer, sampling
        self.call_format, self.max_model_len, self.model_name = call_format, max_model_len, model_name
        self.template_kwargs = dict(chat_template_kwargs or {})
        self.episodes = Episodes()
        self._pending: "queue.Queue" = queue.Queue()
        self._stop = threading.Event()
        # partial rollouts: between rounds the engine is the trainer's, and calls wait (pause/resume)
        self._serving = threading.Event()
        self._serving.set()
        self._engine_busy = threading.Lock()
        self._omp_threads = torch.get_num_threads()  # the engine thread generates with the main thread's OpenMP count
        routes = {
            ("POST", "/v1/chat/completions"): self._answering(self._chat),
            ("POST", "/v1/completions"): self._answering(self._complete),
            ("POST", "/inference/v1/generate"): self._answering(self._tokens),
            ("POST", "/inference/v1/abort_requests"): self._answering(self._abort),
            ("GET", "/v1/models"): lambda body: (
                200,
                {
                    "object": "list",
                    "data": [
                        {"id": model_name, "object": "model", "owned_by": "dsgrpo", "max_model_len": max_model_len}
                    ],
                },
            ),
            ("GET", "/health"): lambda body: (200, {"status": "ok"}),
        }
        self.server = json_server(
            routes,
            host,
            port,
            token,
            max_request_bytes,
            max_connections=256,
            read_timeout_s=60.0,
            header_fields={"X-Episode-Id": "episode_id", "X-Session-ID": "episode_id"},
            openai_errors=True,
        )
        self.host, self.port = host, self.server.server_address[1]
        self._threads = [
            threading.Thread(target=self.server.serve_forever, name="openai-endpoint", daemon=True),
            threading.Thread(target=self._engine_loop, name="openai-endpoint-engine", daemon=True),
        ]
        for t in self._threads:
            t.start()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def close(self) -> None:
        self._stop.set()
        self._serving.set()
        self.server.shutdown()
        self.server.server_close()

    def pause(self) -> None:
        """No engine call starts once this returns (one under way finishes first): calls that arrive wait, and are
        generated after resume() — with the weights the engine has then (partial rollouts: after the sync)."""
        self._serving.clear()
        with self._engine_busy:
            pass

    def resume(self) -> None:
        self._serving.set()

    # ------------------------------------------------------------------------------------------------ requests
    @staticmethod
    def _answering(route):
        def answer(body):
            try:
                return route(body)
            except RequestError as exc:
                return exc.reply()

        return answer

    def _common(self, body: dict) -> Tuple[Episode, int, SamplingConfig, Optional[int], Optional[int]]:
        if body.get("model") not in (None, self.model_name):
            raise RequestError(
                f"The model {body.get('model')!r} does not exist; this endpoint serves {self.model_name!r}.",
                "model",
                "model_not_found",
                status=404,
            )
        if not isinstance(body.get("stream", False), bool):
            raise RequestError("stream must be true or false", "stream")
        options = body.get("stream_options")
        if options is not None and not (isinstance(options, dict) and body.get("stream")):
            raise RequestError("stream_options is an object, and only with stream=true", "stream_options")
        episode = self.episodes.get(body.get("episode_id"))
        n = body.get("n", 1)
        if not isinstance(n, int) or not 1 <= n <= MAX_N:
            raise RequestError(f"n must be an integer from 1 to {MAX_N}", "n")
        for key, kind in (("temperature", (int, float)), ("top_p", (int, float)), ("top_k", int)):
            # read, then left at the trainer's: the trained log-probs are the policy's at its temperature, top_p
            # and top_k, so tokens sampled at an agent's own settings would be weighed by the wrong ratio
            if body.get(key) is not None and (not isinstance(body[key], kind) or isinstance(body[key], bool)):
                raise RequestError(f"{key} must be a number", key)
        extra = dict(self.sampling.extra)
        if body.get("stop") is not None:
            stop = [body["stop"]] if isinstance(body["stop"], str) else body["stop"]
            if not (isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= 8):
                raise RequestError("stop must be a string or a list of at most 8 strings", "stop")
            extra["stop"] = stop
        wanted = body.get("max_completion_tokens", body.get("max_tokens"))
        if wanted is not None and (not isinstance(wanted, int) or isinstance(wanted, bool) or wanted < 1):
            raise RequestError("max_tokens must be a positive integer", "max_tokens")
        seed = body.get("seed")
        if seed is not None and not isinstance(seed, int):
            raise RequestError("seed must be an integer", "seed")
        return episode, n, replace(self.sampling, extra=extra), wanted, seed

    def _room(self, episode: Episode, prompt_ids: List[int], extends: bool, wanted: Optional[int]) -> int:
        """Tokens this call may sample: what it asks (max_tokens) within the episode's budget. A request past the
        model's context is refused, as vLLM and OpenAI refuse it; past the episode's budget (the trainer's
        max_completion_length, not the model's limit) it is given what is left, and a choice cut there finishes
        with "length"."""
        if self.max_model_len is not None and len(prompt_ids) >= self.max_model_len:
            raise RequestError(
                f"the prompt has {len(prompt_ids)} tokens; the engine's context holds {self.max_model_len}",
                "messages",
                "context_length_exceeded",
            )
        if self.max_model_len is not None and wanted is not None and len(prompt_ids) + wanted > self.max_model_len:
            raise RequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{len(prompt_ids) + wanted} tokens ({len(prompt_ids)} in the messages, {wanted} in the completion). "
                "Please reduce the length of the messages or completion.",
                "max_tokens",
                "context_length_exceeded",
            )
        start = len(episode.calls[episode.chain_start()].prompt_ids) if extends else len(prompt_ids)
        room = episode.budget - episode.spent(extends) - (len(prompt_ids) - start)
        if self.max_model_len is not None:
            room = min(room, self.max_model_len - len(prompt_ids))
        if room <= 0:
            raise RequestError(
                f"this episode's token budget is used up: its conversation holds "
                f"{len(prompt_ids) - start} tokens after its first prompt"
                + (f" and its earlier chains {episode.spent(extends)}" if episode.spent(extends) else "")
                + f", and the trainer trains at most {episode.budget} (max_completion_length)",
                "messages",
                "context_length_exceeded",
            )
        return min(room, wanted) if wanted is not None else room

    def _chat(self, body: dict) -> Tuple[int, dict]:
        episode, n, sampling, wanted, seed = self._common(body)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError("messages must be a non-empty list", "messages")
        messages = [normal_message(m, i) for i, m in enumerate(messages)]
        answers_a_call(messages)
        tools = body.get("tools") or None
        if tools is not None and not (
            isinstance(tools, list)
            and all(
                isinstance(t, dict) and isinstance(t.get("function"), dict) and "name" in t["function"] for t in tools
            )
        ):
            raise RequestError("tools must be a list of {'type': 'function', 'function': {'name', ...}}", "tools")
        choice = body.get("tool_choice")
        if choice not in (None, "auto", "none"):
            raise RequestError("tool_choice: only 'auto' and 'none' are served", "tool_choice")
        if choice == "none":
            tools = None
        with episode.lock:
            prompt_ids, extends = self._chat_prompt(episode, messages, tools)
            room = self._room(episode, prompt_ids, extends, wanted)
        choices = self._generate(prompt_ids, n, sampling, room, seed)
        out = []
        for i, c in enumerate(choices):
            text = self.tokenizer.decode(
                c.ids[:-1] if c.ids and c.ids[-1] == self.tokenizer.eos_token_id else c.ids, skip_special_tokens=False
            )
            message = assistant_message(text, self.call_format)
            c.answer = normal_message(message, 0)
            reply = {"role": "assistant", "content": message["content"] or None}
            if message.get("tool_calls"):
                reply["tool_calls"] = [
                    {
                        "id": f"call_{uuid.uuid4().hex[:24]}",
                        "type": "function",
                        "function": {
                            "name": t["function"]["name"],
                            "arguments": json.dumps(t["function"]["arguments"]),
                        },
                    }
                    for t in message["tool_calls"]
                ]
            finish = "length" if c.truncated else ("tool_calls" if message.get("tool_calls") else "stop")
            out.append({"index": i, "message": reply, "finish_reason": finish, "logprobs": None})
        self._record(episode, Call(prompt_ids, choices, extends, messages))
        return _answer(
            body,
            {
                "id": f"chatcmpl-{uuid.uuid4().hex}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": self.model_name,
                "choices": out,
                "usage": _usage(prompt_ids, choices),
            },
        )

    def _chat_prompt(self, episode: Episode, messages: List[dict], tools) -> Tuple[List[int], bool]:
        """(prompt ids, whether they continue the episode's last call): see the module's docstring."""
        last = episode.calls[-1] if episode.calls else None
        if last is not None and last.messages is not None:
            k = len(last.messages)
            if len(messages) > k + 1 and messages[:k] == last.messages:
                for j, c in enumerate(last.choices):
                    if _answer_matches(c.answer, messages[k]):
                        last.chosen = j
                        after = ids_after_reply(self.tokenizer, messages[k + 1 :], self.template_kwargs)
                        if c.ids and after and c.ids[-1] == after[0] and after[0] in self.tokenizer.all_special_ids:
                            after = after[1:]  # the model sampled the end-of-turn token the template starts with
                        return last.prompt_ids + c.ids + after, True
        text = self.tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=True, **self.template_kwargs
        )
        return self.tokenizer(text, add_special_tokens=False)["input_ids"], False

    def _complete(self, body: dict) -> Tuple[int, dict]:
        episode, n, sampling, wanted, seed = self._common(body)
        prompt = body.get("prompt")
        if isinstance(prompt, str) and prompt:
            prompt_ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        elif isinstance(prompt, list) and prompt and all(_is_token(t, self.tokenizer) for t in prompt):
            prompt_ids = list(prompt)
        else:
            raise RequestError("prompt must be a non-empty string or a list of token ids of this model", "prompt")
        with episode.lock:
            extends = self._continues(episode, prompt_ids)
            room = self._room(episode, prompt_ids, extends, wanted)
        choices = self._generate(prompt_ids, n, sampling, room, seed)
        self._record(episode, Call(prompt_ids, choices, extends))
        out = [
            {
                "index": i,
                "text": self.tokenizer.decode(c.ids, skip_special_tokens=True),
                "logprobs": None,
                "finish_reason": "length" if c.truncated else "stop",
            }
            for i, c in enumerate(choices)
        ]
        return _answer(
            body,
            {
                "id": f"cmpl-{uuid.uuid4().hex}",
                "object": "text_completion",
                "created": int(time.time()),
                "model": self.model_name,
                "choices": out,
                "usage": _usage(prompt_ids, choices),
            },
        )

    def _tokens(self, body: dict) -> Tuple[int, dict]:
        """vLLM's token-in/token-out route, as verifiers' TrainClient (renderers' generate) calls it: the prompt as
        token ids, sampling_params ({max_tokens, n, seed, stop, stop_token_ids; temperature, top_p and top_k stay
        the trainer's}), the episode in X-Session-ID. The answer: the sampled ids and their log-probs, each entry
        carrying its token both as vLLM's `token_id` and as `"token_id:<id>"` (what renderers check)."""
        params = body.get("sampling_params", {})
        if not isinstance(params, dict):
            raise RequestError("sampling_params must be an object", "sampling_params")
        if body.get("stream"):
            raise RequestError("stream is not served on /inference/v1/generate: ask for the whole answer", "stream")
        keys = ("n", "max_tokens", "seed", "stop", "temperature", "top_p", "top_k")
        episode, n, sampling, wanted, seed = self._common(
            {"model": body.get("model"), "episode_id": body.get("episode_id"), **{k: params.get(k) for k in keys}}
            | {"n": params.get("n", 1)}
        )
        stop_ids = params.get("stop_token_ids")
        if stop_ids is not None:
            if not (isinstance(stop_ids, list) and all(_is_token(t, self.tokenizer) for t in stop_ids)):
                raise RequestError("stop_token_ids must be a list of token ids of this model", "sampling_params")
            sampling = replace(sampling, extra={**sampling.extra, "stop_token_ids": list(stop_ids)})
        prompt_ids = body.get("token_ids")
        if not (isinstance(prompt_ids, list) and prompt_ids and all(_is_token(t, self.tokenizer) for t in prompt_ids)):
            raise RequestError("token_ids must be a non-empty list of token ids of this model", "token_ids")
        with episode.lock:
            extends = self._continues(episode, prompt_ids)
            room = self._room(episode, prompt_ids, extends, wanted)
        choices = self._generate(prompt_ids, n, sampling, room, seed)
        self._record(episode, Call(list(prompt_ids), choices, extends))
        request_id = body.get("request_id") if isinstance(body.get("request_id"), str) else uuid.uuid4().hex
        out = [
            {
                "index": i,
                "finish_reason": "length" if c.truncated else "stop",
                "stop_reason": None,
                "token_ids": c.ids,
                "logprobs": {
                    "content": [
                        {"token_id": t, "token": f"token_id:{t}", "logprob": lp, "top_logprobs": []}
                        for t, lp in zip(c.ids, c.logprobs)
                    ]
                },
                "weight_versions": _version_spans(c.versions),
            }
            for i, c in enumerate(choices)
        ]
        return 200, {
            "request_id": request_id,
            "output_mode": "tokens",
            "model": self.model_name,
            "created": int(time.time()),
            "prompt_token_ids": list(prompt_ids),
            "choices": out,
            "usage": _usage(prompt_ids, choices),
        }

    def _abort(self, body: dict) -> Tuple[int, dict]:
        """vLLM's abort route: accepted and answered at once. A call here is generated in one engine batch with
        the calls sent beside it and recorded for training; there is nothing to cancel that would not leave its
        episode's record short, so an aborted call simply completes."""
        ids = body.get("request_ids")
        if not (isinstance(ids, list) and all(isinstance(i, str) for i in ids)):
            raise RequestError("request_ids must be a list of strings", "request_ids")
        return 200, {}

    def _continues(self, episode: Episode, prompt_ids: List[int]) -> bool:
        """Whether token ids continue the episode's last call: its prompt + one choice's sampled ids, then more
        (that choice becomes the one the chain trains)."""
        last = episode.calls[-1] if episode.calls else None
        for j, c in enumerate(last.choices if last else []):
            head = last.prompt_ids + c.ids
            if len(prompt_ids) > len(head) and prompt_ids[: len(head)] == head:
                last.chosen = j
                return True
        return False

    def _record(self, episode: Episode, call: Call) -> None:
        with episode.lock:
            episode.calls.append(call)

    # ------------------------------------------------------------------------------------------------ the engine
    def _generate(
        self, prompt_ids: List[int], n: int, sampling: SamplingConfig, max_tokens: int, seed: Optional[int]
    ) -> List[Choice]:
        done = threading.Event()
        slot: dict = {}
        self._pending.put((prompt_ids, n, sampling, max_tokens, seed, done, slot))
        done.wait()
        if "error" in slot:
            raise RuntimeError(f"the engine failed: {slot['error']}")
        return slot["choices"]

    def _engine_loop(self) -> None:
        compat.engine_thread_threads(self._omp_threads)
        while not self._stop.is_set():
            try:
                first = self._pending.get(timeout=0.1)
            except queue.Empty:
                continue
            time.sleep(BATCH_WINDOW_S)  # let the calls sent together arrive
            batch = [first]
            while True:
                try:
                    batch.append(self._pending.get_nowait())
                except queue.Empty:
                    break
            groups: Dict[str, list] = {}
            for item in batch:  # one engine call per sampling setting; each row cut to its own max_tokens
                groups.setdefault(json.dumps(item[2].to_json(), sort_keys=True, default=str), []).append(item)
            while not self._stop.is_set():
                with self._engine_busy:  # checked under the lock: pause() waits for a call under way
                    if self._serving.is_set():
                        for items in groups.values():
                            self._run(items)
                        break
                self._serving.wait(0.1)

    def _run(self, items: list) -> None:
        try:
            longest = max(item[3] for item in items)
            rollout = self.generator.generate(
                [item[0] for item in items],
                [item[1] for item in items],
                replace(items[0][2], max_tokens=longest),
                seeds=[item[4] for item in items],
            )
            row = 0
            for prompt_ids, n, _, max_tokens, _, done, slot in items:
                choices = []
                for _ in range(n):
                    ids, lps = rollout.completion_ids[row], rollout.sampler_logprobs[row]
                    versions = (
                        rollout.weight_versions[row]
                        if rollout.weight_versions
                        else [self.generator.weight_version] * len(ids)
                    )
                    choices.append(
                        Choice(
                            list(ids[:max_tokens]),
                            list(lps[:max_tokens]),
                            list(versions[:max_tokens]),
                            rollout.truncated[row] or len(ids) > max_tokens,
                        )
                    )
                    row += 1
                slot["choices"] = choices
                done.set()
        except Exception as exc:  # noqa: BLE001 - every waiting request hears of it; the endpoint goes on
            for item in items:
                item[6]["error"] = f"{type(exc).__name__}: {exc}"
                item[5].set()


def _is_token(t, tokenizer) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and 0 <= t < len(tokenizer)


def _version_spans(versions: List[int]) -> List[dict]:
    """vLLM's weight_versions: contiguous [start, end) spans of output tokens sampled with one weight version."""
    spans: List[dict] = []
    for i, v in enumerate(versions):
        if spans and spans[-1]["version"] == str(v):
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": str(v), "start": i, "end": i + 1})
    return spans


def _usage(prompt_ids: List[int], choices: List[Choice]) -> dict:
    completion = sum(len(c.ids) for c in choices)
    return {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": completion,
        "total_tokens": len(prompt_ids) + completion,
    }


def _answer(body: dict, reply: dict):
    """The reply as one JSON object, or as OpenAI's stream of chunks when the request asked for stream=true."""
    if not body.get("stream"):
        return 200, reply
    return 200, EventStream(stream_chunks(reply, bool((body.get("stream_options") or {}).get("include_usage"))))


def stream_chunks(reply: dict, include_usage: bool) -> List[dict]:
    """A whole chat or text completion as the chunks OpenAI streams it in: per chat choice, the role, the content,
    each tool call (index, id, name, arguments) and the finish reason; per text choice, its text with its finish
    reason; then, when asked, a last chunk with the usage and no choices."""
    head = {"id": reply["id"], "created": reply["created"], "model": reply["model"]}
    chunks = []
    if reply["object"] == "chat.completion":
        head["object"] = "chat.completion.chunk"
        for choice in reply["choices"]:
            message, i = choice["message"], choice["index"]
            deltas = [{"role": "assistant", "content": ""}]
            if message.get("content"):
                deltas.append({"content": message["content"]})
            deltas += [{"tool_calls": [{"index": k, **call}]} for k, call in enumerate(message.get("tool_calls", []))]
            chunks += [
                {**head, "choices": [{"index": i, "delta": d, "finish_reason": None, "logprobs": None}]} for d in deltas
            ]
            chunks.append(
                {
                    **head,
                    "choices": [{"index": i, "delta": {}, "finish_reason": choice["finish_reason"], "logprobs": None}],
                }
            )
    else:
        head["object"] = "text_completion"
        chunks += [{**head, "choices": [choice]} for choice in reply["choices"]]
    if include_usage:
        chunks = [{**c, "usage": None} for c in chunks] + [{**head, "choices": [], "usage": reply["usage"]}]
    return chunks
