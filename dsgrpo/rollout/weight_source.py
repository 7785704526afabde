"""The policy's weights as vLLM's weight-transfer API wants them: a `WeightSource` over a DeepSpeed policy (ZeRO-3
partitioned, or whole under ZeRO-2), named and shaped as the Hugging Face checkpoint, one decoder layer at a time.

    source.metadata()      [(name, dtype, full shape)] from the partitioned shapes: nothing is gathered
    source.groups()        the names of each group (one decoder layer; embeddings before, final norm and lm_head after)
    source.prepare(g)      group g gathered (one coalesced gather) and converted: LoRA merged, fused MoE experts
                           split, a tied lm_head added; valid until its release()
    iter(source)           (name, tensor) in metadata order, what vLLM's own trainer engines (ipc, nccl) iterate

Gathering is collective: every training rank prepares every group, in order. How a group is gathered is a gather
strategy (engines/gather.py): DeepSpeed's coalesced all-gather, or on one CPU host a shared buffer every rank maps;
whole (ZeRO-2) weights are handed out as they are, without a copy."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, List, NamedTuple, Tuple

import torch

from .. import compat
from ..engines.gather import GatheredGroup, layer_groups
from ..engines.weights import base_model, checkpoint_layout, checkpoint_units


class ParamMeta(NamedTuple):
    name: str
    dtype: torch.dtype
    shape: Tuple[int, ...]


@dataclass
class PreparedGroup:
    index: int
    names: List[str]
    tensors: List[torch.Tensor]
    gathered: GatheredGroup
    gather_s: float = 0.0
    convert_s: float = 0.0
    checksums: List[list] = field(default_factory=list)
    # views of memory the sync reuses (the shared buffer's slots): a consumer that keeps a tensor past its group
    # must copy it
    borrowed: bool = False

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def release(self) -> None:
        self.tensors = []
        self.gathered.release()


class Zero3WeightSource:
    """vLLM's WeightSource contract (metadata, groups, iteration in metadata order, held_names) over a DeepSpeed
    policy. `gather`: a strategy with `.group(params) -> GatheredGroup`. `checksum`: each prepared tensor's float64
    sum, sum of squares and size, taken as it is prepared (verify_weight_sync compares what the engine received)."""

    def __init__(self, module: torch.nn.Module, tied_lm_head: bool, gather, checksum: bool = False):
        self.module, self.model, self.gather, self.checksum = module, base_model(module), gather, checksum
        self.tied = tied_lm_head
        units = checkpoint_units(module)
        self.layout = checkpoint_layout(module)
        self.group_units = [[units[i] for i in idx] for idx in layer_groups([u.name for u in units])]
        self._meta: List[ParamMeta] = []
        self._names: List[List[str]] = []
        for group in self.group_units:
            names = []
            for unit in group:
                dtype = unit.dtype
                for name, shape in self.layout[unit.name]:
                    self._meta.append(ParamMeta(name, dtype, tuple(shape)))
                    names.append(name)
                    if tied_lm_head and name.endswith("embed_tokens.weight"):
                        self._meta.append(ParamMeta("lm_head.weight", dtype, tuple(shape)))
                        names.append("lm_head.weight")
            self._names.append(names)

    # ---- what vLLM's engines read
    def metadata(self) -> List[ParamMeta]:
        return list(self._meta)

    def groups(self) -> List[List[str]]:
        return [list(names) for names in self._names]

    def held_names(self):
        return None  # every rank takes part in every group's gather

    def __iter__(self) -> Iterator[Tuple[str, torch.Tensor]]:
        for index in range(len(self.group_units)):
            group = self.prepare(index)
            try:
                yield from zip(group.names, group.tensors)
            finally:
                group.release()

    def iter_groups(self) -> Iterator[Tuple[List[str], List[torch.Tensor]]]:
        for index in range(len(self.group_units)):
            group = self.prepare(index)
            try:
                yield group.names, group.tensors
            finally:
                group.release()

    # ---- sizes, for buffers and the memory bound
    def sharded_bytes(self) -> List[int]:
        """Per group, the full bytes of its ZeRO-3 parameters (what a gather materialises)."""
        out = []
        for group in self.group_units:
            params = {id(p): p for u in group for p in u.params if compat.is_zero3_param(p)}
            out.append(sum(compat.full_numel(p) * p.element_size() for p in params.values()))
        return out

    def total_bytes(self) -> int:
        return sum(int(torch.Size(m.shape).numel()) * torch.empty((), dtype=m.dtype).element_size() for m in self._meta)

    # ---- one group
    def prepare(self, index: int) -> PreparedGroup:
        """Gather group `index` (collective) and convert it to checkpoint names and layout."""
        units = self.group_units[index]
        start = time.perf_counter()
        params = list({id(p): p for u in units for p in u.params}.values())
        gathered = self.gather.group(params)
        gather_s = time.perf_counter() - start
        start = time.perf_counter()
        names, tensors = [], []
        with torch.no_grad():
            for unit in units:
                if unit.combine is not None:  # a LoRA layer (W + ΔW) or a quantised weight, from the gathered tensors
                    with compat.params_holding(unit.params, [gathered.tensors[id(p)] for p in unit.params]):
                        tensor = unit.combine()
                else:
                    tensor = gathered.tensors[id(unit.params[0])]
                if self.layout[unit.name] == [(unit.name, tuple(tensor.shape))]:
                    out = [(unit.name, tensor)]
                else:  # a fused MoE tensor: expert by expert, as the checkpoint names them
                    out = list(compat.to_checkpoint_format(self.model, {unit.name: tensor}).items())
                if self.tied and unit.name.endswith("embed_tokens.weight"):
                    out.append(("lm_head.weight", tensor))
                for name, t in out:
                    names.append(name)
                    tensors.append(t)
        if names != self._names[index]:
            raise RuntimeError(
                f"weight sync: group {index} produced {names[:4]}..., its metadata says "
                f"{self._names[index][:4]}...: the source's order is broken"
            )
        checksums = [compat.tensor_checksum(t) for t in tensors] if self.checksum else []
        return PreparedGroup(
            index, names, tensors, gathered, gather_s, time.perf_counter() - start, checksums, borrowed=gathered.reused
        )


def prefetched(
    source: Zero3WeightSource, ahead: bool, on_error: Callable[[BaseException], None] = None
) -> Iterator[PreparedGroup]:
    """Every group of `source`, prepared one ahead on a worker thread (with `ahead`): group g+1 is gathered and
    converted while the caller loads group g. The caller releases each group it is given. All of the sync's
    collectives happen on the worker thread (the caller issues none until this generator is exhausted)."""
    n = len(source.group_units)
    if not ahead or n <= 1:
        for index in range(n):
            yield source.prepare(index)
        return
    import queue
    import threading

    handoff: "queue.Queue" = queue.Queue()
    stop = threading.Event()
    in_flight = threading.Semaphore(2)  # the group being loaded and the next one: never a third

    def work():
        try:
            for index in range(n):
                in_flight.acquire()
                if stop.is_set():
                    return
                group = source.prepare(index)
                release = group.release

                def release_and_free(release=release):
                    release()
                    in_flight.release()

                group.release = release_and_free
                handoff.put(group)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, raised there
            handoff.put(exc)

    worker = threading.Thread(target=work, name="dsgrpo-weight-sync", daemon=True)
    worker.start()
    try:
        for _ in range(n):
            item = handoff.get()
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        in_flight.release()  # a worker waiting for room sees the stop
        while worker.is_alive() or not handoff.empty():  # release what it still hands over, so it can finish
            try:
                item = handoff.get(timeout=0.1)
            except queue.Empty:
                continue
            if isinstance(item, PreparedGroup):
                item.release()
        worker.join()
