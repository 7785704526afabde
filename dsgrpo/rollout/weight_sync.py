"""After an optimizer step, the policy's weights reach the generation engine: `WeightSync` prepares them a decoder
layer at a time (rollout/weight_source.py), the generator loads each group (vLLM's native weight-transfer API where
it has one), every phase is timed (sync/* metrics), the engine's weights are labelled with the version they are,
and with verify_weight_sync the engine's checksums of what it received are compared with what was sent. The rest
streams weights to engines in other processes (a vLLM server, split placement's generators):
rollout/weight_stream.py."""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

from .. import compat

from ..engines.weights import checkpoint_layout


def expected_checkpoint_shapes(module, tied_lm_head: bool) -> Dict[str, Tuple[int, ...]]:
    """Names and full shapes the sync will send (ZeRO-3 keeps the full shape in `ds_shape`; fused MoE experts are
    sent one expert at a time, as the checkpoint names them)."""
    shapes = {name: shape for entries in checkpoint_layout(module).values() for name, shape in entries}
    if tied_lm_head:
        emb = [n for n in shapes if n.endswith("embed_tokens.weight")]
        if emb:
            shapes["lm_head.weight"] = shapes[emb[0]]
    return shapes


def check_against_checkpoint(module, model_path: str, tied_lm_head: bool) -> None:
    """A reload that fails half-way leaves vLLM's weights on the meta device and kills the engine, so check
    names and shapes against the checkpoint vLLM loaded before the first sync."""
    import glob
    import os

    from safetensors import safe_open

    files = glob.glob(os.path.join(model_path, "*.safetensors"))
    if not files:
        return  # a hub id or .bin checkpoint: nothing local to compare against
    on_disk = {}
    for f in files:
        with safe_open(f, framework="pt") as fh:
            for key in fh.keys():
                on_disk[key] = tuple(fh.get_slice(key).get_shape())
    sending = expected_checkpoint_shapes(module, tied_lm_head)
    missing = sorted(set(on_disk) - set(sending))
    wrong = sorted(n for n in set(on_disk) & set(sending) if on_disk[n] != sending[n])
    if missing or wrong:
        raise ValueError(
            f"Weight sync would not match the checkpoint vLLM loaded from {model_path}: "
            f"missing {missing[:5]}, shape mismatch {wrong[:5]}. The policy must be the same "
            "architecture as that checkpoint."
        )


class WeightSyncError(RuntimeError):
    """A weight sync that stalled, or whose engine received other weights than were sent."""


@dataclass
class SyncStats:
    """What one sync cost, by phase (seconds; gather and convert run on the prefetching thread, overlapped with the
    load of the previous group: `wait_s` is the part of them the load did not hide)."""

    version: str = "0"
    gather_s: float = 0.0  # the groups' gathers (collective)
    convert_s: float = 0.0  # LoRA merges, MoE splits, checksums
    wire_s: float = 0.0  # moving the bytes to another process (server mode, split placement); 0 in-process
    load_s: float = 0.0  # the engine taking them in (vLLM's load, its repack, the prefix-cache reset)
    wait_s: float = 0.0  # the loading thread waiting for the next group
    verify_s: float = 0.0
    total_s: float = 0.0
    bytes: int = 0
    groups: int = 0
    peak_extra_bytes: int = 0  # full weights held at once beyond the policy's own (per rank; the shared buffer once)
    gather: str = ""
    path: str = ""  # how the engine took them in: native (vLLM's weight-transfer API), reload, stream

    def metrics(self) -> Dict[str, float]:
        out = {
            f"sync/{k}": float(getattr(self, k))
            for k in (
                "gather_s",
                "convert_s",
                "wire_s",
                "load_s",
                "wait_s",
                "verify_s",
                "total_s",
                "bytes",
                "peak_extra_bytes",
            )
        }
        memcpy = memcpy_seconds(self.bytes)
        if memcpy > 0 and self.total_s > 0:
            out["sync/x_memcpy"] = self.total_s / memcpy
        return out


_memcpy_rate: Dict[Tuple[str, int], float] = {}
MEMCPY_PROBE_BYTES = (1 << 20, 64 << 20)  # the smallest and largest copy memcpy_seconds times


def memcpy_seconds(nbytes: int) -> float:
    """Seconds a plain copy of `nbytes` takes here: what a sync is compared with (sync/x_memcpy). One copy of the
    same size, clamped to 1-64 MiB, is timed (best of 5) once per process and size, and scaled. A sync smaller than
    64 MiB is compared with a copy of its own size (the caches help both alike), and the probe costs a rank what
    the sync moves, not 64 MiB of fresh pages: 0.6-0.85 s of the demo's first step on a loaded 2-core machine."""
    if nbytes <= 0:
        return 0.0
    from .. import device

    where = device.torch_device(torch.cuda.current_device()) if device.on_gpu() else torch.device("cpu")
    size = min(max(nbytes, MEMCPY_PROBE_BYTES[0]), MEMCPY_PROBE_BYTES[1])
    key = (str(where), size)
    if key not in _memcpy_rate:
        src = torch.ones(size, dtype=torch.uint8, device=where)
        dst = torch.empty_like(src)
        best = float("inf")
        for _ in range(5):
            device.synchronize()
            start = time.perf_counter()
            dst.copy_(src)
            device.synchronize()
            best = min(best, time.perf_counter() - start)
        _memcpy_rate[key] = size / best
    return nbytes / _memcpy_rate[key]


class WeightSync:
    """The weight sync of one trainer: the policy's WeightSource (rollout/weight_source.py) with its gather strategy,
    the groups prepared one ahead, loaded by the generator, versioned and (verify_weight_sync) checked.

    Gather strategy: on one CPU host with ZeRO-3 partitions, a shared buffer every rank maps (engines/gather.py:
    the gathers are memcpys); elsewhere DeepSpeed's coalesced all-gather, one per layer. A stall past
    weight_sync_timeout_s in the shared buffer's barriers fails the step naming the phase and the ranks that did not
    arrive; DeepSpeed's own gathers are bounded by the process group's timeout, and the heartbeat names the rank and
    its phase (sync/gather, sync/load)."""

    def __init__(self, module, tied: bool, args, prefetch: Optional[bool] = None):
        from .. import device, dist
        from ..engines.gather import DeepSpeedGather, SharedMemoryGather
        from .weight_source import Zero3WeightSource

        self.args = args
        self.timeout_s = float(args.weight_sync_timeout_s)
        self.verify = args.verify_weight_sync
        world = dist.world_size()
        sharded = any(compat.is_zero3_param(p) for p in module.parameters())
        side_ok = world > 1 and not dist.is_split()
        self.side = dist.side_group(self.timeout_s) if side_ok else None
        self.prefetch = side_ok if prefetch is None else prefetch
        gather = DeepSpeedGather()
        if side_ok and sharded and not device.on_gpu() and dist.one_host():
            probe = Zero3WeightSource(module, tied, gather)
            need = max(probe.sharded_bytes()) + int(args.weight_sync_bucket_bytes)
            # a tmpfs too small for the buffer (a container's 64 MB /dev/shm) would kill a rank with SIGBUS mid-write
            fits = all(dist.all_gather_object(shm_free_bytes() >= need + (64 << 20)))
            if fits:
                path = dist.broadcast_object(
                    f"/dev/shm/dsgrpo-weights-{os.getpid()}-{uuid.uuid4().hex[:8]}" if dist.is_main() else None
                )
                gather = SharedMemoryGather(
                    probe.sharded_bytes(),
                    int(args.weight_sync_bucket_bytes),
                    dist.rank(),
                    world,
                    path,
                    create=dist.is_main(),
                    barrier=self._barrier,
                )
            elif dist.is_main():
                print(
                    f"dsgrpo: note: /dev/shm has less than the {need >> 20} MiB the weight sync's shared buffer "
                    "needs; gathering through DeepSpeed instead (slower on CPU). Enlarge /dev/shm (docker: "
                    "--shm-size) to use it.",
                    flush=True,
                )
        self.gather = gather
        self.source = Zero3WeightSource(module, tied, gather, checksum=self.verify != "off")
        self.last: Optional[SyncStats] = None

    def _barrier(self, reason: str) -> None:
        from .. import dist

        try:
            dist.monitored_barrier(reason, self.side, self.timeout_s)
        except TimeoutError as exc:
            from .. import watchdog

            lost = watchdog.explain(exc)  # a peer that died mid-sync is named as any lost rank is
            if lost is not None:
                raise lost from None
            raise WeightSyncError(
                f"weight sync stalled on rank {dist.rank()} waiting until {exc} "
                f"(weight_sync_timeout_s={self.timeout_s:g})"
            ) from None

    def sync(self, generator, version: str) -> SyncStats:
        """Every training rank: the policy's weights into `generator`, labelled `version`."""
        from ..engines.gather import GatherStats
        from .weight_source import prefetched

        GatherStats.reset()
        stats = SyncStats(version=str(version), gather=self.gather.name)
        start = time.perf_counter()
        sent: list = []
        groups = prefetched(self.source, ahead=self.prefetch)

        def counted():
            waited = time.perf_counter()
            for group in groups:
                stats.wait_s += time.perf_counter() - waited
                stats.gather_s += group.gather_s
                stats.convert_s += group.convert_s
                stats.bytes += group.nbytes
                stats.groups += 1
                sent.extend(zip(group.names, group.checksums))
                yield group
                waited = time.perf_counter()

        received = (
            generator.load_weight_groups(counted(), stats)
            if generator.loads_weight_groups
            else _load_flat(generator, counted(), stats)
        )
        stats.peak_extra_bytes = GatherStats.peak_bytes
        if self.verify != "off" and received is not None:
            t = time.perf_counter()
            not_held = generator.weights_not_held()
            check_received([s for s in sent if s[0] not in not_held], received, version)
            stats.verify_s = time.perf_counter() - t
        stats.total_s = time.perf_counter() - start
        self.last = stats
        return stats


def shm_free_bytes() -> int:
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def _load_flat(generator, groups, stats: SyncStats):
    """A generator without group loading: the tensors as one stream; the time it takes them is its load (or, for
    one that sends them on, its wire)."""

    def flat():
        for group in groups:
            try:  # a consumer may keep a tensor past its group: views of reused memory are copied first
                yield from zip(group.names, [t.clone() for t in group.tensors] if group.borrowed else group.tensors)
            finally:
                group.release()

    start = time.perf_counter()
    generator.load_weights(flat())
    spent = time.perf_counter() - start - stats.wait_s
    if generator.sends_weights:
        stats.wire_s += spent
    else:
        stats.load_s += spent
    stats.path = "stream"
    return generator.received_checksums()


def check_received(sent: list, received: list, version: str) -> None:
    """The engine's checksums of what it received against the trainer's of what it sent, tensor by tensor."""
    if len(received) != len(sent):
        raise WeightSyncError(
            f"weight sync (version {version}): the engine received {len(received)} tensors, {len(sent)} were sent"
        )
    for (name, mine), (their_name, theirs) in zip(sent, received):
        if name != their_name or not _same_checksum(mine, theirs):
            raise WeightSyncError(
                f"weight sync (version {version}): {their_name} as the engine received it "
                f"(sum, sum of squares, size {theirs}) differs from {name} as sent ({mine}): "
                "the engine would sample from other weights than the policy's"
            )


def _same_checksum(a, b) -> bool:
    if a[2] != b[2]:
        return False
    return all(abs(x - y) <= 1e-9 * max(1.0, abs(x), abs(y)) for x, y in zip(a[:2], b[:2]))


class TrainerWeightSync:
    """The weight sync a trainer owns (its source syncs through it, and so does a server's first push): a WeightSync
    built at the first sync an engine needs (collective, as every sync is) and built again for another module."""

    def __init__(self, args, tied_lm_head: bool):
        self.args, self.tied = args, tied_lm_head
        self.current: Optional[WeightSync] = None

    def __call__(self, policy_module, generator, version: str = "0") -> Optional[SyncStats]:
        """Every rank calls this after every optimizer step that precedes a generation."""
        if not generator.needs_weight_sync():
            return None
        if self.current is None or self.current.source.module is not policy_module:
            self.current = WeightSync(policy_module, self.tied, self.args)
        return self.current.sync(generator, str(version))
