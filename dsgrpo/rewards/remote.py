"""Remote scorers: `RemoteReward` posts a batch as JSON to an HTTP endpoint; `serve_reward` serves any reward
function or reward model over HTTP, so a heavy reward model can live on other machines.

Wire format (JSON both ways, nothing else is ever evaluated or unpickled):
    POST /score  {"prompts": [...], "completions": [...], "completion_ids": [[int]], "columns": {name: [...]}}
    200          {"rewards": [float | null, ...]}
"""

from __future__ import annotations

import json
import math
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import ThreadingHTTPServer
from typing import Callable, List, Optional
from urllib.parse import urlparse

from ..http import json_server


class RemoteRewardError(RuntimeError):
    """The scorer could not be reached or answered nonsense; the step fails rather than train on made-up rewards."""


class RemoteReward:
    def __init__(
        self,
        url: str,
        timeout: float = 30.0,
        retries: int = 2,
        backoff: float = 0.5,
        token: Optional[str] = None,
        name: Optional[str] = None,
    ):
        parsed = urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(f"RemoteReward url={url!r}: expected http(s)://host:port/path.")
        self.url, self.timeout, self.retries, self.backoff, self.token = url, timeout, retries, backoff, token
        self.__name__ = name or f"remote_{parsed.hostname}_{parsed.port or ''}".rstrip("_")
        self.retried = 0  # attempts after a failed one, since the trainer last read them (rewards/<name>/retries)
        self._count = threading.Lock()  # async reward calls run in threads

    def _headers(self) -> dict:
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        return headers

    def check(self) -> None:
        """At trainer start, before any compute: the scorer answers, and takes our token. GET /ready (dsgrpo
        serve-reward's, behind its token); a scorer without that route (404/405) is reachable all the same."""
        health = self.url.rsplit("/", 1)[0] + "/ready"
        try:
            with urllib.request.urlopen(
                urllib.request.Request(health, headers=self._headers()), timeout=min(self.timeout, 10.0)
            ):
                return
        except urllib.error.HTTPError as exc:
            if exc.code in (401, 403):
                raise RemoteRewardError(
                    f"Remote reward {self.__name__} at {self.url} refuses our token (HTTP "
                    f"{exc.code}): set the reward's token to the server's --token."
                ) from None
            if exc.code < 500:
                return
            problem = f"HTTP {exc.code}"
        except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
            problem = str(getattr(exc, "reason", exc))
        raise RemoteRewardError(
            f"Remote reward {self.__name__} at {self.url} cannot be reached ({problem}), checked "
            "before training starts. Start `dsgrpo serve-reward` there, or fix the URL."
        )

    def pop_retries(self) -> int:
        with self._count:
            n, self.retried = self.retried, 0
        return n

    def __call__(self, prompts, completions, completion_ids=None, **columns) -> List[Optional[float]]:
        body = json.dumps(
            {"prompts": prompts, "completions": completions, "completion_ids": completion_ids or [], "columns": columns}
        ).encode()
        headers = self._headers()
        last_error: Exception | None = None
        for attempt in range(self.retries + 1):
            if attempt:
                with self._count:
                    self.retried += 1
            try:
                req = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
                with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                    rewards = json.loads(resp.read())["rewards"]
                if not isinstance(rewards, list) or len(rewards) != len(completions):
                    raise RemoteRewardError(
                        f"{self.url} returned {type(rewards).__name__} of length "
                        f"{len(rewards) if isinstance(rewards, list) else '?'} for {len(completions)} completions."
                    )
                return rewards
            except urllib.error.HTTPError as exc:
                if exc.code < 500:  # the request itself is wrong: retrying cannot help
                    raise RemoteRewardError(
                        f"{self.url} refused the request: HTTP {exc.code} {exc.read()[:200]!r}"
                    ) from None
                last_error = exc
            except (urllib.error.URLError, TimeoutError, ConnectionError, json.JSONDecodeError, KeyError) as exc:
                last_error = exc
            if attempt < self.retries:
                time.sleep(self.backoff * 2**attempt)
        raise RemoteRewardError(
            f"Remote reward {self.__name__} at {self.url} failed after {self.retries + 1} "
            f"attempts (timeout {self.timeout} s): {last_error}. Is `dsgrpo serve-reward` running "
            "there? Training stops rather than use made-up rewards."
        )


def make_server(
    score: Callable,
    host: str = "127.0.0.1",
    port: int = 8000,
    token: Optional[str] = None,
    max_request_bytes: int = 16 << 20,
    max_batch: int = 4096,
    max_connections: int = 64,
    read_timeout_s: float = 10.0,
) -> ThreadingHTTPServer:
    """An HTTP server for `score` (not started; dsgrpo.http's JSON server). Binds to loopback unless told otherwise."""

    def score_route(req: dict):
        prompts, completions = req["prompts"], req["completions"]
        ids, columns = req.get("completion_ids") or [], req.get("columns") or {}
        if not (
            isinstance(prompts, list)
            and isinstance(completions, list)
            and isinstance(columns, dict)
            and len(prompts) == len(completions)
        ):
            raise ValueError("prompts and completions must be lists of equal length; columns a mapping")
        if len(completions) > max_batch:
            return 413, {"error": f"at most {max_batch} completions per request"}
        try:
            rewards = [
                None if r is None or (isinstance(r, float) and math.isnan(r)) else float(r)
                for r in score(prompts=prompts, completions=completions, completion_ids=ids, **columns)
            ]
        except Exception as exc:  # noqa: BLE001 - the scorer's own failure (a 500 the client retries), not a bad request
            return 500, {"error": f"{type(exc).__name__}: {exc}"}
        return 200, {"rewards": rewards}

    # /health is open (load balancers); /ready takes the token like /score, so a client can check it before scoring
    routes = {
        ("POST", "/score"): score_route,
        ("GET", "/health"): lambda _: (200, {"ok": True}),
        ("GET", "/ready"): lambda _: (200, {"ok": True}),
    }
    return json_server(
        routes, host, port, token, max_request_bytes, max_connections=max_connections, read_timeout_s=read_timeout_s
    )


def serve_reward(argv: List[str]) -> int:
    """`dsgrpo serve-reward (--func module:function | --builtin NAME | --model PATH) [--host] [--port]`; the token
    comes from DSGRPO_REWARD_TOKEN (required beyond loopback)."""
    import argparse

    from ..http import server_token

    p = argparse.ArgumentParser(prog="dsgrpo serve-reward")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--func", help="a reward function as package.module:function")
    src.add_argument("--builtin", help="a built-in reward name, e.g. accuracy_reward")
    src.add_argument("--model", help="a sequence-classification reward model (path or cached hub id)")
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default loopback only; anything else needs a token in DSGRPO_REWARD_TOKEN)",
    )
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--token",
        default=None,
        help="loopback only, with a warning: prefer DSGRPO_REWARD_TOKEN (a "
        "command line is readable by every local user)",
    )
    p.add_argument("--max-request-bytes", type=int, default=16 << 20)
    p.add_argument("--max-batch", type=int, default=4096)
    p.add_argument("--max-connections", type=int, default=64, help="open connections served at once (more: 503)")
    p.add_argument("--read-timeout", type=float, default=10.0, help="seconds a connection may stay silent")
    p.add_argument(
        "--code-sandbox",
        default="isolated",
        choices=("isolated", "none"),
        help="--builtin code_reward: contain the code (default), or not ('none': trusted data only)",
    )
    a = p.parse_args(argv)
    try:
        token = server_token("dsgrpo serve-reward", a.host, a.token, "DSGRPO_REWARD_TOKEN")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if a.func:
        from ..importing import import_object

        score = import_object(a.func)
    elif a.builtin:
        from .builtins import BUILTIN_REWARDS
        from .sandbox import CodeReward

        score = BUILTIN_REWARDS.get(a.builtin)
        if isinstance(score, CodeReward):  # a sandbox that cannot be built here refuses to serve, as training does
            score = score.with_isolation(a.code_sandbox)
            score.check()
    else:
        from .models import LocalRewardModel

        score = LocalRewardModel(a.model)
    server = make_server(
        score, a.host, a.port, token, a.max_request_bytes, a.max_batch, a.max_connections, a.read_timeout
    )
    print(f"serving reward on http://{a.host}:{server.server_address[1]}/score", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0
