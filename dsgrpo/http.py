"""JSON over HTTP, the only wire format dsgrpo's servers speak (`dsgrpo serve-reward`, `dsgrpo vllm-serve`):
nothing received is evaluated or unpickled. Servers bind to loopback unless told otherwise, take an optional
bearer token, and refuse bodies over a size limit before reading them."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Dict, Optional, Tuple

Route = Callable[[dict], Tuple[int, dict]]   # request body → (status, reply)


class HTTPError(RuntimeError):
    def __init__(self, url: str, status: int, message: str):
        super().__init__(f"{url}: HTTP {status}: {message}")
        self.status = status


def json_server(routes: Dict[Tuple[str, str], Route], host: str, port: int, token: Optional[str],
                max_request_bytes: int, open_paths: Tuple[str, ...] = ("/health",)) -> ThreadingHTTPServer:
    """A threading server (not started) answering `routes[(method, path)]`; every path but `open_paths` needs the
    bearer token when one is set. 401 without it, 413 over the size limit, 400 for a body that is not JSON."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, fmt, *args):  # quiet by default
            pass

        def _reply(self, code: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            try:
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):  # the client gave up (a timeout, a refused body)
                pass

        def _handle(self, method: str) -> None:
            path = self.path.split("?")[0].rstrip("/") or "/"
            route = routes.get((method, path))
            if route is None:
                known = ", ".join(f"{m} {p}" for m, p in routes)
                return self._reply(404, {"error": f"no {method} {path}; this server answers {known}"})
            if token and path not in open_paths and self.headers.get("Authorization") != f"Bearer {token}":
                return self._reply(401, {"error": "missing or wrong bearer token"})
            body = {}
            if method == "POST":
                length = int(self.headers.get("Content-Length") or 0)
                if length <= 0 or length > max_request_bytes:
                    return self._reply(413, {"error": f"request body must be 1..{max_request_bytes} bytes"})
                try:
                    body = json.loads(self.rfile.read(length))
                except json.JSONDecodeError as exc:
                    return self._reply(400, {"error": f"bad request: {exc}"})
            try:
                code, reply = route(body)
            except (ValueError, KeyError, TypeError) as exc:
                code, reply = 400, {"error": f"bad request: {type(exc).__name__}: {exc}"}
            except Exception as exc:  # noqa: BLE001 - the route's own failure: report it, keep serving
                code, reply = 500, {"error": f"{type(exc).__name__}: {exc}"}
            self._reply(code, reply)

        def do_GET(self):
            self._handle("GET")

        def do_POST(self):
            self._handle("POST")

    return ThreadingHTTPServer((host, port), Handler)


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
