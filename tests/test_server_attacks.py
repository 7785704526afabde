"""dsgrpo's servers attacked as whoever can reach their port would (issue 25): serve-reward and vllm-serve refuse
to listen beyond loopback without a token, and take it from the environment; a reward server answers every
malformed request with a 400 and one line (no traceback, no route list), drops idle connections and caps them;
vllm-serve's weight channel listens on its own address only and carries JSON, never pickle."""

import json
import pickle
import socket
import threading
import time

import pytest
import torch

from dsgrpo import dist
from dsgrpo.rewards.remote import make_server, serve_reward
from dsgrpo.rollout.weight_stream import manifest_dtype


@pytest.fixture
def server(capsys):
    servers = []

    def start(**kw):
        srv = make_server(lambda prompts, completions, **k: [1.0] * len(completions), port=0, **kw)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return srv.server_address[1]

    yield start
    for srv in servers:
        srv.shutdown()
        srv.server_close()
    assert "Traceback" not in capsys.readouterr().err


def raw(port: int, data: bytes, timeout: float = 5.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        chunks = []
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)


def status_and_error(reply: bytes):
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)["error"]


def post(path: str, body: bytes, headers: str = "", length=None) -> bytes:
    length = len(body) if length is None else length
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {length}\r\n{headers}\r\n").encode() + body


GOOD = json.dumps({"prompts": ["p"], "completions": ["c"]}).encode()


def test_every_malformed_request_is_a_400_with_one_line(server):
    port = server(token="s3cret")
    auth = "Authorization: Bearer s3cret\r\n"
    assert b" 200 " in raw(port, post("/score", GOOD, auth))[:20]
    cases = {
        "Content-Length must be an integer": post("/score", GOOD, auth, length="abc"),
        "1..": post("/score", GOOD, auth, length="-5"),
        "not UTF-8": post("/score", b'{"prompts": ["\xff\xfe"], "completions": ["c"]}', auth),
        "nested too deeply": post("/score", b"[" * 100_000 + b"]" * 100_000, auth),
        "not JSON": post("/score", b"{nope", auth),
        "a JSON object": post("/score", b"[1, 2]", auth),
        "missing field": post("/score", b'{"prompts": []}', auth),
        "ended after": post("/score", GOOD[:10], auth, length=len(GOOD)),
        "equal length": post("/score", json.dumps({"prompts": [], "completions": ["c"]}).encode(), auth),
    }
    for expected, request in cases.items():
        code, error = status_and_error(raw(port, request))
        assert code in (400, 413) and expected in error and "\n" not in error, (expected, code, error)
    code, error = status_and_error(raw(port, b"GARBAGE\r\n\r\n"))  # http.server's own refusal, as JSON
    assert code == 400 and "\n" not in error
    # the token is checked before the path: an unauthenticated probe learns nothing, and a 404 lists no routes
    assert status_and_error(raw(port, post("/admin", GOOD)))[0] == 401
    code, error = status_and_error(raw(port, post("/admin", GOOD, auth)))
    assert code == 404 and "score" not in error
    for token in ("s3cre", "s3cret ", "s3cretX" * 100, "\u00e9\u00e9"):
        header = f"Authorization: Bearer {token}\r\n".encode("utf-8").decode("latin-1")
        assert status_and_error(raw(port, post("/score", GOOD, header)))[0] == 401


def test_idle_connections_are_capped_and_dropped(server):
    port = server(max_connections=8, read_timeout_s=0.5)
    before = threading.active_count()
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(300)]
    time.sleep(0.3)
    assert threading.active_count() - before <= 8  # no more threads than the cap, whatever connects
    answers = []
    for s in idle:  # beyond the cap: an immediate 503, not a thread waiting; within it, closed once idle 0.5 s
        s.settimeout(5)
        answers.append(s.recv(64))
        s.close()
    assert sum(a.startswith(b"HTTP/1.0 503") for a in answers) >= 250
    assert all(a.startswith(b"HTTP/1.0 503") or a == b"" for a in answers)
    assert b" 200 " in raw(port, post("/score", GOOD))[:20]  # the slots came back


def test_serve_reward_needs_a_token_from_the_environment_beyond_loopback(monkeypatch, capsys):
    monkeypatch.delenv("DSGRPO_REWARD_TOKEN", raising=False)
    assert serve_reward(["--builtin", "think_format_reward", "--host", "0.0.0.0", "--port", "0"]) == 2
    assert "DSGRPO_REWARD_TOKEN" in capsys.readouterr().err
    assert serve_reward(["--builtin", "code_reward", "--host", "0.0.0.0", "--port", "0", "--token", "t"]) == 2
    assert "readable by every user" in capsys.readouterr().err


def test_weight_channel_listens_on_its_address_and_carries_json_only():
    port = dist._free_port()
    store = dist.Communicator.rendezvous_store("127.0.0.1", port, is_master=True, timeout_s=10)
    listening = [line.split()[1] for line in open("/proc/net/tcp").read().splitlines()[1:] if line.split()[3] == "0A"]
    assert f"0100007F:{port:04X}" in listening and f"00000000:{port:04X}" not in listening
    # a trainer (rank 1) and a server (rank 0) in two threads; the "trainer" sends pickle instead of JSON
    groups = {}

    def join(rank):
        client = (
            store if rank == 0 else dist.Communicator.rendezvous_store("127.0.0.1", port, is_master=False, timeout_s=10)
        )
        groups[rank] = dist.Communicator(client, "g", rank=rank, world=2, timeout_s=10)

    threads = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
    [t.start() for t in threads]
    [t.join() for t in threads]

    class Boom:
        def __reduce__(self):
            return (print, ("pickle ran",))

    payload = pickle.dumps(Boom())
    results = {}

    def send():
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        groups[1].broadcast(torch.tensor([data.numel()]), src=1)
        groups[1].broadcast(data, src=1)

    def receive():
        try:
            results["got"] = groups[0].broadcast_plain(None, src=1)
        except Exception as exc:  # noqa: BLE001
            results["error"] = exc

    threads = [threading.Thread(target=send), threading.Thread(target=receive)]
    [t.start() for t in threads]
    [t.join(30) for t in threads]
    assert "got" not in results and isinstance(results["error"], (UnicodeDecodeError, ValueError))
    # and a manifest is plain data of known dtypes only
    assert manifest_dtype([["w", [2, 3], "torch.float32"]]) is torch.float32
    for bad in (
        [["w", [2], "torch.load"]],
        [["w", [-1], "torch.float32"]],
        [["w", [2], "torch.float32"], ["v", [2], "torch.bfloat16"]],
        [["w", "2", "torch.float32"]],
        {"w": 1},
    ):
        with pytest.raises(ValueError):
            manifest_dtype(bad)
