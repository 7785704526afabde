"""The training side of `vllm_mode="server"`: every training rank sends its prompts (with their seeds) to a
`dsgrpo vllm-serve` server, and training rank 0 pushes the new weights there after each update.

The push goes over a process group of its own (dist.Communicator: NCCL on GPU, gloo on CPU) joined by the server's
ranks and training rank 0, bucket by bucket from the gathered ZeRO-3 parameters (rollout/weight_sync.py), announced
by POST /update_weights. Every push carries a version `<run id>/<n>` that the server reports with every
generation, so a rank never trains on completions from weights it did not push: a server that restarted (it then
serves the checkpoint on disk) is re-initialised at the next push, and a generation from anything but the last
push stops the run with the reason. The first push happens at start-up, so round 0 samples from the policy's own
weights even when the server was started from another checkpoint or served another run before."""

from __future__ import annotations

import os
import sys
import time
import urllib.error
import urllib.parse
import uuid
from typing import Iterable, List, Optional, Tuple

import torch

from .. import dist
from ..http import HTTPError, request_json
from .base import Generator, Rollout, SamplingConfig, decode_routes
from .weight_stream import largest_bucket_bytes, send_weights
from .weight_sync import expected_checkpoint_shapes

TOKEN_ENV = "DSGRPO_VLLM_TOKEN"
POLL_SECONDS = 1.0


def server_url(args) -> str:
    """vllm_server_base_url wins; else http://vllm_server_host:vllm_server_port (0.0.0.0, TRL's default host,
    means this machine)."""
    if args.vllm_server_base_url:
        return args.vllm_server_base_url.rstrip("/")
    host = "127.0.0.1" if args.vllm_server_host in ("0.0.0.0", "") else args.vllm_server_host
    return f"http://{host}:{args.vllm_server_port}"


def wait_for_server(url: str, token: Optional[str], timeout_s: float, say=print) -> dict:
    """GET /health until it answers (at most `timeout_s`), saying once what is awaited; its reply."""
    deadline, said = time.monotonic() + timeout_s, False
    while True:
        try:
            return request_json(f"{url}/health", token=token, timeout=10)
        except (urllib.error.URLError, ConnectionError, OSError) as exc:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"vllm_mode='server': no vLLM server answered at {url}/health within "
                    f"vllm_server_timeout={timeout_s:g} s (last error: {exc}). Start it with "
                    f"`dsgrpo vllm-serve --model <the policy's checkpoint>` and check "
                    "vllm_server_base_url (or vllm_server_host / vllm_server_port)."
                ) from None
            if not said:
                say(
                    f"dsgrpo: waiting up to {timeout_s:g} s for the vLLM server at {url} "
                    f"(`dsgrpo vllm-serve`; vllm_server_timeout) ..."
                )
                said = True
            time.sleep(POLL_SECONDS)


def check_server_model(served: dict, expected: dict, url: str) -> None:
    """The server's checkpoint must have the names and shapes the push sends (a push into another model would
    fail half-way and leave the engine broken)."""
    served = {k: tuple(v) for k, v in served.items()}
    missing = sorted(set(served) - set(expected))  # (the policy may send more: lm_head.weight of tied embeddings)
    wrong = sorted(n for n in set(served) & set(expected) if served[n] != tuple(expected[n]))
    if missing or wrong:
        detail = "; ".join(
            part
            for part in (
                f"shapes differ for {[(n, served[n], tuple(expected[n])) for n in wrong[:3]]}" if wrong else "",
                f"the server has {missing[:3]} the policy lacks" if missing else "",
            )
            if part
        )
        raise ValueError(
            f"vllm_mode='server': the server at {url} serves a different model than the policy "
            f"({detail}). Start `dsgrpo vllm-serve --model` with the policy's checkpoint."
        )


def check_wire_settings(health: dict, policy_module, tied: bool, bucket_bytes: int, url: str) -> None:
    """Before the first push: the server must take the largest bucket this trainer can send (weight_sync_bucket_bytes,
    or a tensor larger than that, sent alone), or the push would break off half-way."""
    from .weight_source import ParamMeta
    from ..engines.weights import checkpoint_layout

    limit = health.get("max_weight_bucket_bytes")
    if limit is None:
        return  # a server of before the setting: it allocates what arrives
    dtype = next(policy_module.parameters()).dtype
    meta = [ParamMeta(n, dtype, tuple(s)) for entries in checkpoint_layout(policy_module).values() for n, s in entries]
    need = largest_bucket_bytes(meta, bucket_bytes)
    if need > int(limit):
        raise ValueError(
            f"vllm_mode='server': this trainer's weight pushes send buckets of up to {need} bytes "
            f"(weight_sync_bucket_bytes={bucket_bytes}, or the largest tensor, sent alone), but the "
            f"server at {url} takes at most {limit}. Start `dsgrpo vllm-serve` with "
            f"--max-weight-bucket-bytes {need}, or lower weight_sync_bucket_bytes."
        )


def check_server_context(max_model_len: Optional[int], args, url: str, longest_prompt: Optional[int] = None) -> None:
    """A prompt plus its completion must fit the server engine's context (vLLM refuses the request otherwise, in
    the middle of a run): max_prompt_length where it is set, else the longest training prompt once the prompts are
    known (rendered with the tools the model is shown; a tool turn's continuation is held to the same budget)."""
    if not max_model_len:
        return
    if args.max_prompt_length is not None:
        prompt, which = args.max_prompt_length, "max_prompt_length"
    elif longest_prompt is not None:
        prompt, which = longest_prompt, f"the longest training prompt ({longest_prompt} tokens, tools listed)"
    else:
        return
    need = prompt + args.max_completion_length
    if need > max_model_len:
        raise ValueError(
            f"vllm_mode='server': {which} + max_completion_length = {need} tokens, but the server at "
            f"{url} runs a {max_model_len}-token context. Start `dsgrpo vllm-serve` with --max-model-len "
            f"{need} (or lower max_prompt_length / max_completion_length)."
        )


class ServerGenerator(Generator):
    """A Generator whose engine is a `dsgrpo vllm-serve` server (one per run; every training rank holds one)."""

    routes = False  # routing_replay='rollout': the server returns each token's experts (checked in __init__)
    sends_weights = True  # the time a sync spends in load_weights is the wire's (sync/wire_s)
    weight_version = 0

    def __init__(self, args):
        """Reach the server (every training rank), before any model is loaded: a missing server or a refused token
        fails in seconds, not after the policy has loaded."""
        self.url = server_url(args)
        self.token = os.environ.get(TOKEN_ENV) or None
        self.timeout_s = float(args.vllm_server_timeout)
        self.group_port = int(args.vllm_group_port)
        self.bucket_bytes = int(args.weight_sync_bucket_bytes)
        self.sending = dist.rank() == 0
        say = (lambda m: print(m, flush=True)) if self.sending else (lambda m: None)
        self.health = wait_for_server(self.url, self.token, self.timeout_s, say)
        self._request("/get_world_size")  # /health answers anyone; this needs the token where one is set
        check_server_context(self.health.get("max_model_len"), args, self.url)
        self.max_model_len: Optional[int] = self.health.get("max_model_len")  # what an agent's call may fill
        self.routes = getattr(args, "routing_replay", "off") == "rollout"
        if self.routes and not self.health.get("routes"):
            raise ValueError(
                f"routing_replay='rollout' with vllm_mode='server': the server at {self.url} does not "
                "return each token's experts. Start it with `dsgrpo vllm-serve ... --routing-replay "
                "rollout` (a GPU server), or set routing_replay='off'."
            )
        self.run_id = dist.broadcast_object(uuid.uuid4().hex[:12] if self.sending else None, src=0)
        self.pushes = 0
        self.server_id: Optional[str] = None
        self.communicator: Optional[dist.Communicator] = None
        self.restarts = 0
        say(f"dsgrpo: vLLM server at {self.url}: {self.health.get('model')} on {self.health.get('world_size')} rank(s)")

    def attach(self, policy_module, tied: bool, weight_sync) -> "ServerGenerator":
        """Check the server's model against the policy, then push the policy's weights (every training rank: the
        gathers are collective), so round 0 samples them whatever the server loaded or served before."""
        check_server_model(self.health.get("checkpoint", {}), expected_checkpoint_shapes(policy_module, tied), self.url)
        check_wire_settings(self.health, policy_module, tied, self.bucket_bytes, self.url)
        weight_sync(policy_module, self)  # the trainer's (weight_sync.TrainerWeightSync)
        return self

    @property
    def version(self) -> str:
        """The weights of the last push: what every generation must come from."""
        return f"{self.run_id}/{self.pushes}"

    def needs_weight_sync(self) -> bool:
        return True

    def end_generation(self) -> None:
        pass

    def needs_weights(self) -> bool:
        return False

    # ---- requests
    def _request(self, path: str, payload: Optional[dict] = None, timeout: Optional[float] = None) -> dict:
        try:
            return request_json(self.url + path, payload, token=self.token, timeout=timeout or self.timeout_s)
        except HTTPError as exc:
            if exc.status == 401:
                raise PermissionError(
                    f"the vLLM server at {self.url} refused the bearer token: set {TOKEN_ENV} to the server's --token."
                ) from None
            raise

    def generate(
        self,
        prompt_ids: List[List[int]],
        counts: List[int],
        sampling: SamplingConfig,
        seeds: Optional[List[int]] = None,
    ) -> Rollout:
        if not any(counts):
            return Rollout([], [], [], [])
        reply = self._request(
            "/generate",
            {"prompt_ids": prompt_ids, "counts": counts, "seeds": seeds, "sampling": sampling.to_json()},
            timeout=max(self.timeout_s, 3600),
        )
        if reply["weight_version"] != self.version:
            raise RuntimeError(self._stale_reason(reply["weight_version"]))
        rows = [list(ids) for ids, n in zip(prompt_ids, counts) for _ in range(n)]
        rollout = Rollout(rows, reply["completion_ids"], reply["logprobs"], reply["truncated"])
        if self.routes:  # checked against the rows here: a server that sends other routes fails now, not mid-forward
            if reply.get("routes") is None:
                raise RuntimeError(
                    f"routing_replay='rollout': the vLLM server at {self.url} sent no routes (was it "
                    "restarted without --routing-replay rollout?)"
                )
            rollout.routes = decode_routes(
                reply["routes"],
                [len(p) + len(c) for p, c in zip(rows, rollout.completion_ids)],
                source=f"the routes from the vLLM server at {self.url}",
            )
        return rollout

    def _stale_reason(self, served: str) -> str:
        try:
            failed = self._request("/health").get("last_error")
        except Exception:  # noqa: BLE001 - the reason below stands without it
            failed = None
        if failed:
            why = f"failed to take the last push ({failed})"
        elif served == "0" or not served.startswith(self.run_id + "/"):
            why = (
                "restarted after the last weight push and now serves the checkpoint it loaded from disk"
                if served == "0"
                else f"holds weights another trainer pushed (version {served})"
            )
        else:
            why = f"serves weights of push {served.split('/')[1]}, not of the last one ({self.pushes})"
        return (
            f"vllm_mode='server': the vLLM server at {self.url} {why}. Generating from them would train on "
            f"completions of stale weights, so the run stops. Resume from the last checkpoint "
            f"(resume_from_checkpoint=True): the trainer pushes the resumed weights before it generates."
        )

    # ---- weights
    def load_weights(self, named_tensors: Iterable[Tuple[str, torch.Tensor]]) -> None:
        """Every training rank (the gathers are collective); rank 0 streams to the server."""
        self.pushes += 1
        if not self.sending:
            # wait until rank 0 has queued the push: with replicated weights (ZeRO-2) no collective gather holds
            # this rank back, and its next /generate must not reach the server ahead of /update_weights
            dist.barrier("the weight push is queued on the vLLM server")
            send_weights(named_tensors, self.bucket_bytes, None, src=0, sending=False)
            return
        self._connect()
        self._request("/update_weights", {"version": self.version})
        dist.barrier("the weight push is queued on the vLLM server")
        try:
            send_weights(
                named_tensors, self.bucket_bytes, self.communicator, src=self.communicator.world - 1, sending=True
            )
        except RuntimeError as exc:
            self.communicator = None  # a broken group is never reused
            raise RuntimeError(
                f"vllm_mode='server': pushing weights to {self.url} failed ({exc}); the server "
                "died or restarted mid-push. Resume from the last checkpoint."
            ) from exc

    def _connect(self) -> None:
        """Rank 0: join the server's weight communicator, again after a restart (a new server_id)."""
        health = self._request("/health")
        if self.communicator is not None and health["server_id"] == self.server_id:
            return
        if self.server_id is not None:
            self.restarts += 1
            print(
                f"dsgrpo: warning: the vLLM server at {self.url} restarted (server {self.server_id} → "
                f"{health['server_id']}); re-initialising its weight communicator and pushing the current weights",
                file=sys.stderr,
                flush=True,
            )
        name = f"{self.run_id}-{uuid.uuid4().hex[:8]}"
        reply = self._request(
            "/init_communicator", {"port": self.group_port, "name": name, "timeout_s": self.timeout_s}
        )
        host = urllib.parse.urlsplit(self.url).hostname or "127.0.0.1"
        store = dist.Communicator.rendezvous_store(host, self.group_port, is_master=False, timeout_s=self.timeout_s)
        world = int(reply["world_size"]) + 1
        self.communicator = dist.Communicator(store, name, rank=world - 1, world=world, timeout_s=self.timeout_s)
        self.server_id = health["server_id"]

    def reset_prefix_cache(self) -> None:
        self._request("/reset_prefix_cache", {})
