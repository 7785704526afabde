"""The trainer's side of an environment host (issue 66): starts the host program (envhost/host.py) in the
ecosystem's interpreter, speaks its JSON-lines protocol, and supervises it. A host that does not answer `hello`
within `start_timeout_s` is an error before training, with the tail of its log; a host that dies mid-run fails the
episodes it held (they score None and are counted) and is started again for the next episode, at most
`max_restarts` times. Nothing here waits without a bound."""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import List, Optional

HOST_PROGRAM = Path(__file__).with_name("host.py")


class EnvHostError(RuntimeError):
    """The host could not start, or died more often than it may be restarted."""


class HostDied(RuntimeError):
    """The host ended while an episode was in it."""


class EnvHost:
    def __init__(
        self,
        environment: str,
        python: str,
        *,
        paths: Optional[List[str]] = None,
        env: Optional[dict] = None,
        log_path: Optional[str] = None,
        start_timeout_s: float = 300.0,
        max_restarts: int = 3,
    ):
        self.environment, self.python = environment, str(python)
        self.paths = [os.path.abspath(p) for p in (paths or [])]
        self.extra_env = dict(env or {})
        self.log_path = log_path or os.path.join(tempfile.mkdtemp(prefix="dsgrpo-env-host-"), "host.log")
        self.start_timeout_s, self.max_restarts = start_timeout_s, max_restarts
        self.versions: dict = {}
        self.restarts = 0  # hosts started again after one died
        self._process: Optional[subprocess.Popen] = None
        self._pending: dict = {}  # request id -> (the host process it went to, its Future)
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._closed = False

    # ---- the process
    def start(self) -> "EnvHost":
        with self._lock:
            self._start()
        return self

    def _start(self) -> None:
        read_end, write_end = os.pipe()
        bin_dir = os.path.dirname(self.python)
        env = {
            **os.environ,
            **self.extra_env,
            # the ecosystem's own tools (verifiers' uv) come first; the user's modules are importable
            "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
            "PYTHONPATH": os.pathsep.join(self.paths + [p for p in [os.environ.get("PYTHONPATH")] if p]),
            "PYTHONUNBUFFERED": "1",
        }
        env.pop("VIRTUAL_ENV", None)
        log = open(self.log_path, "ab")
        try:
            self._process = subprocess.Popen(
                [self.python, str(HOST_PROGRAM), self.environment, "--answers", str(write_end)],
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=log,
                pass_fds=(write_end,),
                env=env,
                start_new_session=True,  # the trainer's Ctrl-C is the trainer's; the host ends with close()
            )
        except OSError as exc:
            raise EnvHostError(f"env host: cannot run {self.python}: {exc}") from None
        finally:
            os.close(write_end)
            log.close()
        answers = os.fdopen(read_end, "r")
        hello: concurrent.futures.Future = concurrent.futures.Future()
        threading.Thread(
            target=self._read, args=(self._process, answers, hello), name="env-host-answers", daemon=True
        ).start()  # one reader a process: it fails only the episodes sent to its own process
        self._send({"op": "hello"})
        try:
            self.versions = hello.result(timeout=self.start_timeout_s)["versions"]
        except Exception as exc:  # noqa: BLE001 - every way of not starting is one clear error
            self._kill()
            reason = (
                str(exc)
                if not isinstance(exc, concurrent.futures.TimeoutError)
                else (f"no answer in {self.start_timeout_s:g} s")
            )
            raise EnvHostError(
                f"env host for {self.environment!r} ({self.python}) did not start: {reason}\n"
                f"its log ({self.log_path}) ends:\n{self.log_tail()}"
            ) from None

    def _read(self, process: subprocess.Popen, answers, hello: concurrent.futures.Future) -> None:
        for line in answers:
            try:
                message = json.loads(line)
            except ValueError:
                continue
            op = message.get("op")
            if op == "hello" and not hello.done():
                hello.set_result(message)
            elif op == "fatal" and not hello.done():
                hello.set_exception(EnvHostError(message.get("error")))
            elif "id" in message:
                with self._lock:
                    _, future = self._pending.pop(message["id"], (None, None))
                if future is not None:
                    _settle(future, message)
        code = process.wait()
        if not hello.done():
            hello.set_exception(EnvHostError(f"the host exited with code {code}"))
        with self._lock:
            lost = [key for key, (owner, _) in self._pending.items() if owner is process]
            pending = [self._pending.pop(key)[1] for key in lost]
        for future in pending:
            _settle(future, HostDied(f"the env host exited (code {code}) during the episode"))

    def alive(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def _send(self, message: dict) -> None:
        self._process.stdin.write((json.dumps(message) + "\n").encode())
        self._process.stdin.flush()

    def _request(self, message: dict) -> tuple:
        """(the request's id, the Future of its answer)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                raise EnvHostError("env host: closed")
            if not self.alive():
                if self.restarts >= self.max_restarts:
                    raise EnvHostError(
                        f"env host for {self.environment!r} died {self.restarts + 1} times (max_restarts="
                        f"{self.max_restarts}); its log ({self.log_path}) ends:\n{self.log_tail()}"
                    )
                self.restarts += 1
                self._start()
            key = next(self._ids)
            self._pending[key] = (self._process, future)
            try:
                self._send({**message, "id": key})
            except OSError:  # it died as we wrote: the reader fails the future
                pass
        return key, future

    def _abandon(self, key: int) -> None:
        """The trainer no longer waits for request `key` (its episode timed out, or was discarded as stale): the
        host cancels it, so an episode that hangs does not hold the host's loop, its connections and the
        endpoint's episode for the rest of the run."""
        with self._lock:
            owner, _ = self._pending.pop(key, (None, None))
            if owner is not None and owner is self._process and self.alive():
                try:
                    self._send({"op": "cancel", "id": key})
                except OSError:
                    pass

    def _kill(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._process is None:
                return
            if self._process.poll() is None:
                try:
                    self._send({"op": "stop"})
                    self._process.stdin.close()
                    self._process.wait(timeout=10)
                except (OSError, subprocess.TimeoutExpired):
                    pass
            self._kill()

    def log_tail(self, lines: int = 20) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "\n".join(f.read().splitlines()[-lines:])
        except OSError:
            return "(no log)"

    # ---- the protocol
    def rows(self, limit: Optional[int] = None, timeout_s: float = 300.0) -> List[dict]:
        """The environment's own rows (its taskset), as dataset rows."""
        answer = self._request({"op": "rows", "limit": limit})[1].result(timeout=timeout_s)
        if answer.get("error"):
            raise EnvHostError(f"env host for {self.environment!r}: rows: {answer['error']}")
        return answer["rows"]

    async def episode(self, row: dict, *, base_url: str, episode_id: str, model: str, tokenizer: str) -> dict:
        """One episode in the host: its answer {reward, metrics, branches, error}. Raises HostDied if the host
        ended during it."""
        request = {
            "op": "episode",
            "row": row,
            "base_url": base_url,
            "episode_id": episode_id,
            "model": model,
            "tokenizer": tokenizer,
        }
        key, future = await asyncio.to_thread(self._request, request)  # a restart takes seconds: not on the loop
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:  # the episode's timeout, or the round gave it up
            self._abandon(key)
            raise


def _settle(future: concurrent.futures.Future, outcome) -> None:
    """Give a request's Future its answer (or exception), unless the trainer gave it up (cancelled) first."""
    try:
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)
    except concurrent.futures.InvalidStateError:
        pass


def python_of(environment: str, python: Optional[str], requirements: Optional[str]) -> str:
    """The interpreter a host runs in: the one given, else the venv built from `requirements` (default: the
    ecosystem's shipped file, e.g. requirements/envs/verifiers.txt for verifiers:...), and for python:... hosts
    without requirements this trainer's own interpreter."""
    if python:
        return python
    kind = environment.partition(":")[0]
    if requirements is None and kind == "python":
        return sys.executable
    from .venvs import ensure_venv

    return str(ensure_venv(requirements or kind))
