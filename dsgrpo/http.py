"""JSON over HTTP, the only wire format dsgrpo's servers speak (`dsgrpo serve-reward`, `dsgrpo vllm-serve`):
nothing received is evaluated or unpickled. A server is reached by whoever can reach its port, so:
loopback unless told otherwise (and then only with a token: `server_token`), the bearer token compared in
constant time, a read timeout on every connection and a cap on open connections, bodies over the size limit
refused before they are read, and every malformed request (a bad Content-Length, bytes that are not UTF-8,
JSON nested too deep, a body that is not an object) answered 400 with a one-line reason, never a traceback."""

from __future__ import annotations

import hmac
import json
import os
import sys
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Dict, Optional, Tuple

Route = Callable[[dict], Tuple[int, dict]]  # request body → (status, reply)
LOOPBACK = ("127.0.0.1", "localhost", "::1")


class EventStream:
    """A reply sent as server-sent events (`text/event-stream`): one `data: {json}` event a dict, then `data:
    [DONE]` (OpenAI's stream=true). A route returns (200, EventStream(events)); the connection closes after it."""

    def __init__(self, events):
        self.events = list(events)


class HTTPError(RuntimeError):
    def __init__(self, url: str, status: int, message: str):
        super().__init__(f"{url}: HTTP {status}: {message}")
        self.status = status


class BadRequest(ValueError):
    """A request the server cannot read: 400 with this one-line reason."""


def server_token(command: str, host: str, flag_token: Optional[str], env_var: str) -> Optional[str]:
    """The bearer token a server requires, from `env_var`; a token given on the command line is readable by every
    local user (/proc/PID/cmdline), so it is refused beyond loopback and warned about on it. A server that binds
    beyond loopback without a token is refused: anyone who reaches the port could use it. Raises ValueError."""
    token = os.environ.get(env_var) or None
    if flag_token:
        if host not in LOOPBACK:
            raise ValueError(
                f"{command}: --token puts the token in the process's command line, readable by every "
                f"user of this machine; export {env_var} instead."
            )
        print(
            f"{command}: warning: --token is readable by every local user in /proc/*/cmdline; prefer {env_var}.",
            file=sys.stderr,
            flush=True,
        )
        token = flag_token
    if host not in LOOPBACK and not token:
        raise ValueError(
            f"{command}: --host {host} exposes this server beyond this machine: set a token in {env_var} "
            "(and give the clients the same one), or bind to 127.0.0.1."
        )
    return token


def json_server(
    routes: Dict[Tuple[str, str], Route],
    host: str,
    port: int,
    token: Optional[str],
    max_request_bytes: int,
    open_paths: Tuple[str, ...] = ("/health",),
    max_connections: int = 64,
    read_timeout_s: float = 10.0,
    header_fields: Optional[Dict[str, str]] = None,
    openai_errors: bool = False,
) -> ThreadingHTTPServer:
    """A threading server (not started) answering `routes[(method, path)]`; every path but `open_paths` needs the
    bearer token when one is set (401 without it, checked before the path is looked up, and a 404 names no
    route). 413 over the size limit, 400 for anything unreadable, 503 beyond `max_connections` open ones; a
    connection idle for `read_timeout_s` is closed. `header_fields` {header: key}: a header's value reaches the
    route as body[key] where the body has none. `openai_errors`: this server's own errors (401, 404, 413, 400, 500)
    in OpenAI's shape, {"error": {"message", "type", "param", "code"}}, as an OpenAI client parses them; else
    {"error": "message"}."""
    expected = f"Bearer {token}".encode() if token else None

    def error(status: int, message: str) -> dict:
        return openai_error(status, message) if openai_errors else {"error": message}

    class Handler(BaseHTTPRequestHandler):
        timeout = read_timeout_s  # every read on the socket (request line, headers, body)

        def log_message(self, fmt, *args):  # quiet by default
            pass

        def _reply(self, code: int, payload) -> None:
            if isinstance(payload, EventStream):
                return self._stream(code, payload)
            data = json.dumps(payload).encode()
            try:
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except OSError:  # the client gave up (a timeout, a refused body)
                self.close_connection = True

        def _stream(self, code: int, stream: EventStream) -> None:
            self.close_connection = True  # no Content-Length: the stream ends with the connection
            try:
                self.send_response(code)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-cache")
                self.send_header("Connection", "close")
                self.end_headers()
                for event in stream.events:
                    self.wfile.write(b"data: " + json.dumps(event).encode() + b"\n\n")
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
            except OSError:
                pass

        def send_error(self, code, message=None, explain=None):
            # http.server's own refusals (a bad request line, too many headers): JSON, one line, like ours, with a
            self.close_connection = True  # status line even when the request line was too broken to name HTTP/1.x
            self.request_version = "HTTP/1.0"
            self._reply(code, {"error": _one_line(message or self.responses.get(code, ("error",))[0])})

        def _authorized(self) -> bool:
            given = (self.headers.get("Authorization") or "").encode("latin-1", "replace")
            return hmac.compare_digest(given, expected)

        def _body(self) -> dict:
            raw = self.headers.get("Content-Length")
            try:
                length = int(raw)
            except (TypeError, ValueError):
                raise BadRequest(f"Content-Length must be an integer (got {_one_line(str(raw))[:40]!r})") from None
            if length <= 0 or length > max_request_bytes:
                raise _TooLarge(f"request body must be 1..{max_request_bytes} bytes")
            data = self.rfile.read(length)
            if len(data) != length:
                raise BadRequest(f"the body ended after {len(data)} of {length} bytes")
            try:
                body = json.loads(data.decode("utf-8"))
            except UnicodeDecodeError:
                raise BadRequest("the body is not UTF-8") from None
            except RecursionError:
                raise BadRequest("the body's JSON is nested too deeply") from None
            except ValueError as exc:
                raise BadRequest(f"the body is not JSON ({_one_line(str(exc))})") from None
            if not isinstance(body, dict):
                raise BadRequest("the body must be a JSON object")
            return body

        def _handle(self, method: str) -> None:
            path = self.path.split("?")[0].rstrip("/") or "/"
            if expected and path not in open_paths and not self._authorized():
                return self._reply(401, error(401, "missing or wrong bearer token"))
            route = routes.get((method, path))
            if route is None:
                return self._reply(404, error(404, f"no {method} {_one_line(path)[:100]}"))
            try:
                body = self._body() if method == "POST" else {}
            except _TooLarge as exc:
                self.close_connection = True
                return self._reply(413, error(413, str(exc)))
            except BadRequest as exc:
                self.close_connection = True
                return self._reply(400, error(400, f"bad request: {exc}"))
            for header, key in (header_fields or {}).items():
                if self.headers.get(header) is not None:
                    body.setdefault(key, self.headers.get(header))
            try:
                code, reply = route(body)
            except KeyError as exc:
                code, reply = 400, error(400, f"bad request: missing field {_one_line(str(exc))}")
            except (ValueError, TypeError) as exc:
                code, reply = 400, error(400, f"bad request: {type(exc).__name__}: {_one_line(str(exc))}")
            except Exception as exc:  # noqa: BLE001 - the route's own failure: report it, keep serving
                code, reply = 500, error(500, f"{type(exc).__name__}: {_one_line(str(exc))}")
            self._reply(code, reply)

        def do_GET(self):
            self._handle("GET")

        def do_POST(self):
            self._handle("POST")

    return _CappedServer((host, port), Handler, max_connections)


class _TooLarge(BadRequest):
    pass


_OPENAI_ERRORS = {  # status: (type, code), as OpenAI's API answers them
    400: ("invalid_request_error", None),
    401: ("invalid_request_error", "invalid_api_key"),
    404: ("invalid_request_error", "unknown_url"),
    413: ("invalid_request_error", "request_too_large"),
    500: ("server_error", None),
}


def openai_error(
    status: int, message: str, param: Optional[str] = None, code: Optional[str] = None, kind: Optional[str] = None
) -> dict:
    """OpenAI's error body: {"error": {"message", "type", "param", "code"}} (type and code as OpenAI's API gives
    them for the status, where not named)."""
    default_kind, default_code = _OPENAI_ERRORS.get(status, ("invalid_request_error", None))
    return {"error": {"message": message, "type": kind or default_kind, "param": param, "code": code or default_code}}


def _one_line(text: str) -> str:
    return " ".join(str(text).split())[:300]


class _CappedServer(ThreadingHTTPServer):
    """At most `max_connections` connections are served at once; one more is answered 503 and closed at once
    instead of holding a thread. A client that resets or times out is not the server's error: no traceback."""

    daemon_threads = True
    request_queue_size = 128  # listen backlog: socketserver's 5 makes a burst of clients wait on SYN retries
    _BUSY = (
        b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: 38\r\n"
        b'Connection: close\r\n\r\n{"error": "too many open connections"}'
    )

    def __init__(self, address, handler, max_connections: int):
        self.slots = threading.BoundedSemaphore(max_connections)
        super().__init__(address, handler)

    def process_request(self, request, client_address):
        if not self.slots.acquire(blocking=False):
            try:
                request.settimeout(1.0)
                request.sendall(self._BUSY)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()

    def handle_error(self, request, client_address):
        pass


def request_json(url: str, payload: Optional[dict] = None, token: Optional[str] = None, timeout: float = 30.0) -> dict:
    """GET (payload None) or POST JSON; the reply's JSON. HTTPError on a non-2xx answer; urllib's URLError when
    nothing answers."""
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, headers=headers, method="GET" if payload is None else "POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        try:
            message = json.loads(exc.read()).get("error", "")
        except (json.JSONDecodeError, ValueError):
            message = str(exc)
        raise HTTPError(url, exc.code, message) from None
