"""`dsgrpo vllm-serve`: generation in processes of its own (other GPUs, other nodes), for `vllm_mode="server"`.

    dsgrpo vllm-serve --model M [--tensor-parallel-size N] [--data-parallel-size D] [--host 127.0.0.1]
                      [--port 8000] [--token T] [--group-port 51216] [--dtype ...] [--max-model-len L]
                      [--routing-replay rollout]

One process serves N·D = 1 engine rank; more run under torchrun (`torchrun --nproc_per_node N·D -m dsgrpo.cli
vllm-serve ...`): every N consecutive ranks form one tensor-parallel engine, D engines split each request. Server
rank 0 answers HTTP; every request becomes a command that all server ranks run in the same order (one command loop,
so a weight update never interleaves with a generation). Weights arrive over a process group of their own
(dist.Communicator: gloo on CPU, NCCL on GPU) from the trainer's rank 0, bucket by bucket, announced by
POST /update_weights.

HTTP (JSON):
    GET  /health            {status, server_id, weight_version, model, world_size, max_model_len, last_error,
                             checkpoint: {name: shape}, routes, max_weight_bucket_bytes}
    GET  /get_world_size    {world_size}                                (the name TRL's client uses)
    POST /generate          {prompt_ids, counts, seeds, sampling} → {completion_ids, logprobs, truncated,
                             weight_version, routes (with --routing-replay rollout: each token's experts,
                             rollout/base.encode_routes)}
    POST /score             {token_ids} → {logprobs}                    (the prompt's log-probs: checks, tests)
    POST /init_communicator {port, name} → {world_size}                 queued; the trainer joins as the last rank
    POST /update_weights    {version} → {queued}                        queued; the buckets follow on the communicator
    POST /reset_prefix_cache
`server_id` changes when the server restarts (it then serves the weights on disk, version "0"); every generation
reports the version it came from, and the trainer never trains on completions of weights it did not push. Binding
to anything but loopback needs --token."""

from __future__ import annotations

import argparse
import glob
import math
import os
import queue
import sys
import threading
import uuid
from typing import Dict, List, Optional

from .. import device, dist
from ..http import json_server, server_token
from .base import Rollout, SamplingConfig, encode_routes


def checkpoint_shapes(model_path: str) -> Dict[str, List[int]]:
    """Names and shapes of the checkpoint the engine loaded (safetensors headers only)."""
    from safetensors import safe_open

    shapes = {}
    for f in glob.glob(os.path.join(model_path, "*.safetensors")):
        with safe_open(f, framework="pt") as fh:
            for key in fh.keys():
                shapes[key] = list(fh.get_slice(key).get_shape())
    return shapes


class EngineServer:
    """The engine side: every server rank runs `serve()`; rank 0 also runs the HTTP front."""

    def __init__(self, a: argparse.Namespace):
        from ..config import GRPOConfig
        from .vllm_engine import VLLMGenerator

        dist.init()
        self.world, self.rank = dist.world_size(), dist.rank()
        self.tp, self.dp = a.tensor_parallel_size, a.data_parallel_size
        if self.world != self.tp * self.dp:
            raise ValueError(
                f"--tensor-parallel-size {self.tp} × --data-parallel-size {self.dp} = "
                f"{self.tp * self.dp} engine ranks, but {self.world} processes run: start the server "
                f"with `torchrun --nproc_per_node {self.tp * self.dp} -m dsgrpo.cli vllm-serve ...`."
            )
        self.model = a.model
        cfg = GRPOConfig(
            output_dir=os.devnull,
            seed=a.seed,
            vllm_max_model_length=a.max_model_len,
            vllm_tensor_parallel_size=self.tp,
            vllm_kv_cache_bytes=a.kv_cache_bytes,
            vllm_gpu_memory_utilization=a.gpu_memory_utilization,
            trust_remote_code=a.trust_remote_code,
            max_completion_length=a.max_completion_length,
            vllm_model_impl=a.vllm_model_impl,
            vllm_enforce_eager={"auto": None, "true": True, "false": False}[a.enforce_eager],
            routing_replay=a.routing_replay,
            report_to="none",
        )
        dist.tensor_parallel_groups(self.tp)  # before the engine: its seed is the engine's index
        # every rank of an engine runs each command with the same request, as external_launcher needs
        self.engine = VLLMGenerator(a.model, cfg, dtype=_dtype(a.dtype))
        self.server_id = uuid.uuid4().hex[:12]
        self.version = "0"  # the weights on disk; a push sets the trainer's "<run>/<n>"
        self.last_error: Optional[str] = None  # of a queued command (a push), reported by /health
        self.communicator: Optional[dist.Communicator] = None
        self.store = None  # (port, TCPStore): one for the server's life
        self.checkpoint = checkpoint_shapes(a.model)
        # the largest weight bucket it accepts (a wire setting both sides must agree on: the trainer checks it
        # before its first push, and every bucket is checked before a byte is allocated for it)
        largest = max((math.prod(s) for s in self.checkpoint.values()), default=0)
        self.max_bucket_bytes = a.max_weight_bucket_bytes or max(64 << 20, 4 * largest)
        self.jobs: "queue.Queue" = queue.Queue()
        self.host, self.group_port = a.host, a.group_port

    # ---- the command loop (every server rank)
    def serve(self) -> None:
        while True:
            job = self.jobs.get() if self.rank == 0 else None
            command = dist.broadcast_object(None if job is None else (job["command"], job["body"]), src=0)
            name, body = command
            try:
                result = getattr(self, f"_{name}")(body)
                error = None
            except Exception as exc:  # noqa: BLE001 - reported to the HTTP caller
                result, error = None, f"{type(exc).__name__}: {exc}"
            if job is not None:
                job["result"], job["error"] = result, error
                job["done"].set()
                if error and job.get("queued"):
                    self.last_error = error
                    print(f"dsgrpo vllm-serve: {name} failed: {error}", file=sys.stderr, flush=True)
            if name == "stop":
                return

    def submit(self, command: str, body: dict, wait: bool = True) -> Optional[dict]:
        """Run a command on every server rank; wait=False returns once it is queued (behind earlier requests,
        ahead of later ones)."""
        job = {"command": command, "body": body, "done": threading.Event(), "queued": not wait}
        self.jobs.put(job)
        if not wait:
            return None
        job["done"].wait()
        if job["error"]:
            raise RuntimeError(job["error"])
        return job["result"]

    # ---- commands
    def _generate(self, body: dict) -> dict:
        prompt_ids, counts, seeds = body["prompt_ids"], body["counts"], body.get("seeds")
        if len(prompt_ids) != len(counts) or (seeds is not None and len(seeds) != len(counts)):
            raise ValueError("prompt_ids, counts and seeds must have one entry per prompt")
        sampling = SamplingConfig(**body["sampling"])
        engine = self.rank // self.tp
        cut = [round(i * len(counts) / self.dp) for i in range(self.dp + 1)]  # engine e takes prompts cut[e]:cut[e+1]
        mine = slice(cut[engine], cut[engine + 1])
        rollout = self.engine.generate(
            prompt_ids[mine], counts[mine], sampling, seeds=None if seeds is None else seeds[mine]
        )
        parts = dist.all_gather_object(rollout.to_json() if self.rank % self.tp == 0 else None)
        full = Rollout.concat([Rollout.from_json(p) for p in parts if p is not None])
        reply = {
            "completion_ids": full.completion_ids,
            "logprobs": full.sampler_logprobs,
            "truncated": full.truncated,
            "weight_version": self.version,
        }
        if full.routes is not None:
            reply["routes"] = encode_routes(full.routes)
        return reply

    def _score(self, body: dict) -> dict:
        from vllm import SamplingParams

        ids = body["token_ids"]
        out = self.engine.llm.generate(
            [{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False
        )[0]
        return {
            "logprobs": [step[t].logprob for step, t in zip(out.prompt_logprobs[1:], ids[1:])],
            "weight_version": self.version,
        }

    def _init_communicator(self, body: dict) -> dict:
        port, timeout_s = int(body["port"]), float(body.get("timeout_s", 300))
        if self.store is None or self.store[0] != port:
            host = self.host if self.host not in ("0.0.0.0", "::") else "127.0.0.1"
            self.store = (
                port,
                dist.Communicator.rendezvous_store(
                    host, port, is_master=self.rank == 0, timeout_s=timeout_s, bind=self.host
                ),
            )
        self.communicator = None  # a new trainer (or the same one after a failure): a new group, a new namespace
        self.communicator = dist.Communicator(
            self.store[1], str(body["name"]), rank=self.rank, world=self.world + 1, timeout_s=timeout_s
        )
        return {"world_size": self.world}

    def _update_weights(self, body: dict) -> dict:
        from .weight_stream import received_weights

        if self.communicator is None:
            raise RuntimeError("no communicator: POST /init_communicator first")
        self.version = "receiving"  # a push that breaks off leaves weights no one can name
        self.engine.load_weights(
            received_weights(
                self.communicator,
                src=self.world,  # resets the prefix cache
                max_bytes=self.max_bucket_bytes,
            )
        )
        self.version, self.last_error = str(body["version"]), None
        return {"weight_version": self.version}

    def _reset_prefix_cache(self, body: dict) -> dict:
        self.engine.llm.reset_prefix_cache()
        return {}

    def _stop(self, body: dict) -> dict:
        return {}

    # ---- HTTP (server rank 0)
    def http(self, token: Optional[str], max_request_bytes: int, port: int):
        def health(_):
            return 200, {
                "status": "ok",
                "server_id": self.server_id,
                "weight_version": self.version,
                "model": self.model,
                "world_size": self.world,
                "checkpoint": self.checkpoint,
                "max_model_len": self.engine.max_model_len,
                "tensor_parallel_size": self.tp,
                "data_parallel_size": self.dp,
                "routes": bool(self.engine.routes),
                "max_weight_bucket_bytes": self.max_bucket_bytes,
                "last_error": self.last_error,
            }

        def run(command):
            def route(body):
                return 200, self.submit(command, body)

            return route

        def queue(command, reply):
            # answered once queued: the trainer joins the communicator (or starts streaming) after it reads this
            def route(body):
                self.submit(command, body, wait=False)
                return 200, reply(body)

            return route

        routes = {
            ("GET", "/health"): health,
            ("GET", "/get_world_size"): lambda _: (200, {"world_size": self.world}),
            ("POST", "/generate"): run("generate"),
            ("POST", "/score"): run("score"),
            ("POST", "/init_communicator"): queue("init_communicator", lambda b: {"world_size": self.world}),
            ("POST", "/update_weights"): queue("update_weights", lambda b: {"queued": str(b["version"])}),
            ("POST", "/reset_prefix_cache"): run("reset_prefix_cache"),
        }
        return json_server(routes, self.host, port, token, max_request_bytes)


def _dtype(name: str):
    import torch

    return {
        "float32": torch.float32,
        "bfloat16": torch.bfloat16,
        "float16": torch.float16,
        "auto": torch.bfloat16 if device.on_gpu() else torch.float32,
    }[name]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dsgrpo vllm-serve", description="Serve a vLLM engine for vllm_mode='server'.")
    p.add_argument("--model", required=True, help="hub id or local path (the policy's checkpoint)")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--data-parallel-size", type=int, default=1)
    p.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default loopback; anything else needs --token)"
    )
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--group-port", type=int, default=51216, help="port of the weight communicator (the trainer's vllm_group_port)"
    )
    p.add_argument(
        "--token",
        default=None,
        help="loopback only, with a warning: prefer DSGRPO_VLLM_TOKEN (a command line is readable by every local user)",
    )
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-completion-length", type=int, default=512)
    p.add_argument("--kv-cache-bytes", type=int, default=None, help="KV cache per engine rank (CPU default: 1 GiB cap)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--vllm-model-impl", default="vllm", choices=("vllm", "transformers", "auto"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--enforce-eager",
        default="auto",
        choices=("auto", "true", "false"),
        help="no torch.compile / CUDA graphs (auto: compiled on GPU, eager on CPU)",
    )
    p.add_argument("--max-request-bytes", type=int, default=64 << 20)
    p.add_argument(
        "--max-weight-bucket-bytes",
        type=int,
        default=0,
        help="the largest weight bucket a push may send (default: 64 MiB or four bytes per element of the "
        "checkpoint's largest tensor, the larger); a trainer whose buckets can be larger is refused "
        "before its first push",
    )
    p.add_argument(
        "--routing-replay",
        default="off",
        choices=("off", "rollout"),
        help="rollout: return each token's routed experts with its completion, for a trainer with "
        "routing_replay='rollout' (MoE models; vLLM's enable_return_routed_experts, GPU only)",
    )
    return p


def main(argv: List[str]) -> int:
    a = parser().parse_args(argv)
    try:  # the trainer reads the same DSGRPO_VLLM_TOKEN
        token = server_token("dsgrpo vllm-serve", a.host, a.token, "DSGRPO_VLLM_TOKEN")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if a.routing_replay == "rollout" and not device.on_gpu():
        from ..engines.routing import VLLM_CPU_CANNOT

        print(
            f"error: --routing-replay rollout returns each token's experts, and {VLLM_CPU_CANNOT} Serve from a "
            "GPU, or train with use_vllm=False (the policy's own generate captures them).",
            file=sys.stderr,
        )
        return 2
    server = EngineServer(a)
    if server.rank == 0:
        http = server.http(token, a.max_request_bytes, a.port)
        threading.Thread(target=http.serve_forever, daemon=True, name="dsgrpo-vllm-http").start()
        print(
            f"dsgrpo vllm-serve: serving {a.model} on http://{a.host}:{http.server_address[1]} "
            f"({server.world} engine rank(s), server_id {server.server_id})",
            flush=True,
        )
    server.serve()
    return 0
