"""Everything that talks to torch.distributed. Collectives are called by every rank, in the same order, from
the training loop; nothing here branches on rank except `is_main()` for printing and file writes.

`init()` works under torchrun, the deepspeed launcher (it passes --local_rank), srun wrappers that export
RANK/WORLD_SIZE, and a plain `python script.py` (a world of one on a free local port)."""

from __future__ import annotations

import datetime
import os
import socket
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from . import compat, device


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init(timeout_s: float = 1800) -> None:
    """Initialise the default process group (idempotent). Must run BEFORE the vLLM engine is created.
    `timeout_s` bounds every collective (TrainingArguments' ddp_timeout); DEEPSPEED_TIMEOUT (minutes) wins."""
    if dist.is_available() and dist.is_initialized():
        return
    from .process_exit import end_with_launcher

    end_with_launcher()  # before RANK is filled in below for a world of one
    adopt_slurm_env()
    if "RANK" not in os.environ:  # plain `python script.py` or a notebook: a world of one
        os.environ.update(
            RANK="0",
            WORLD_SIZE="1",
            LOCAL_RANK="0",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=os.environ.get("MASTER_PORT", str(_free_port())),
        )
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1"))
    import warnings

    import deepspeed

    # DeepSpeed 0.19 calls torch.distributed APIs that torch 2.13 deprecates, once per collective
    warnings.filterwarnings("ignore", category=FutureWarning, message=r".*torch\.distributed\..* is deprecated")
    minutes = os.environ.get("DEEPSPEED_TIMEOUT")
    timeout = datetime.timedelta(minutes=float(minutes)) if minutes else datetime.timedelta(seconds=timeout_s)
    _timeout["s"] = timeout.total_seconds()
    deepspeed.init_distributed(dist_backend=device.dist_backend(), timeout=timeout)
    if device.on_gpu():
        torch.cuda.set_device(local_rank())
    elif world_size(EVERYONE) > 1:
        barrier("every rank has mapped every rank's DeepSpeed shared-memory segment", EVERYONE)
        compat.unlink_deepspeed_cpu_shm_segment(rank(EVERYONE))


_timeout = {"s": 1800.0}


def collective_timeout_s() -> float:
    """How long a collective waits for its peers before it fails (set by init)."""
    return _timeout["s"]


def rendezvous_store_client(timeout_s: float):
    """A client of its own to the job's rendezvous store (MASTER_ADDR:MASTER_PORT: rank 0's TCPStore, or
    torchrun's agent's), for the watchdog's heartbeats: usable from another thread while collectives run."""
    return dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


def adopt_slurm_env() -> None:
    """An `srun` task per rank (launch_scripts/slurm/train.sbatch): take rank and world from Slurm's variables.
    MASTER_ADDR/MASTER_PORT come from the batch script."""
    if "RANK" not in os.environ and "SLURM_PROCID" in os.environ and "SLURM_NTASKS" in os.environ:
        os.environ.update(
            RANK=os.environ["SLURM_PROCID"],
            WORLD_SIZE=os.environ["SLURM_NTASKS"],
            LOCAL_RANK=os.environ.get("SLURM_LOCALID", "0"),
        )
        if "SLURM_NTASKS_PER_NODE" in os.environ:
            os.environ.setdefault("LOCAL_WORLD_SIZE", os.environ["SLURM_NTASKS_PER_NODE"].split("(")[0])


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


# ---------------------------------------------------------------------------------------------- split roles
# In the async trainer's "split" placement the lowest ranks train and the others only generate. On training
# ranks every collective here (and every group-less collective inside DeepSpeed) then means "the training
# ranks"; `EVERYONE` names the whole world for the few exchanges between trainers and generators, and
# `WEIGHTS` the group that carries weight broadcasts (training rank 0 + the generators).
EVERYONE = "everyone"
WEIGHTS = "weights"
_split: Dict[str, object] = {}


def split_roles(num_trainers: int) -> bool:
    """Every rank calls this once: make the training group, the weight-broadcast group (training rank 0 + the
    generators) and size-one groups for DeepSpeed's model-parallel view. Returns True on a training rank."""
    world, me = dist.get_world_size(), dist.get_rank()
    trainers = list(range(num_trainers))
    train_group = dist.new_group(trainers)
    broadcast_group = dist.new_group([0] + list(range(num_trainers, world)))
    singles = [dist.new_group([r]) for r in range(world)]
    trains = me < num_trainers
    _split.update(trainers=num_trainers, broadcast=broadcast_group, trains=trains)
    if trains:
        _split.update(train=train_group, single=singles[me])
        compat.confine_deepspeed_comm(train_group)  # DeepSpeed's group-less collectives: the trainers
    return trains


def is_split() -> bool:
    return bool(_split)


def num_trainers() -> int:
    return int(_split.get("trainers", world_size()))


def _group(group):
    """None: the training ranks (the world unless split); EVERYONE: the world; WEIGHTS: the broadcast group."""
    if group == EVERYONE:
        return None
    if group == WEIGHTS:
        return _split["broadcast"]
    if group == TP:
        return _tp["group"]
    if group == TP_WORKER:
        return _tp["worker_group"]
    if group == SP:
        return _sp["group"]
    return _split.get("train")


class TrainingGroupMPU:
    """DeepSpeed's `mpu` view in split placement: data parallel over the training ranks, no model parallelism."""

    def get_data_parallel_group(self):
        return _split["train"]

    def get_data_parallel_rank(self):
        return dist.get_rank(_split["train"])

    def get_data_parallel_world_size(self):
        return dist.get_world_size(_split["train"])

    def get_data_parallel_group_ranks(self):
        return dist.get_process_group_ranks(_split["train"])

    def get_model_parallel_group(self):
        return _split["single"]

    def get_model_parallel_rank(self):
        return 0

    def get_model_parallel_world_size(self):
        return 1

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size

    def get_tensor_model_parallel_src_rank(self):
        return dist.get_rank()


def deepspeed_mpu():
    return TrainingGroupMPU() if "train" in _split else None


# ---------------------------------------------------------------------------------------------- queries
def rank(group=None) -> int:
    if not is_initialized():
        return int(os.environ.get("RANK", 0))
    return dist.get_rank(_group(group))


def world_size(group=None) -> int:
    if not is_initialized():
        return int(os.environ.get("WORLD_SIZE", 1))
    return dist.get_world_size(_group(group))


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))


def local_world_size() -> int:
    adopt_slurm_env()
    # torchrun exports LOCAL_WORLD_SIZE, the deepspeed launcher LOCAL_SIZE
    return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", os.environ.get("WORLD_SIZE", 1))))


def is_main() -> bool:
    """Safe without a process group. (Global rank 0 is also training rank 0 in split placement.)"""
    return (dist.get_rank() if is_initialized() else int(os.environ.get("RANK", 0))) == 0


def _many(group) -> bool:
    return is_initialized() and world_size(group) > 1


def barrier(reason: str, group=None) -> None:
    """A barrier with a reason, so a hang in a log points at its cause."""
    if _many(group):
        dist.barrier(group=_group(group))


def all_gather(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Concatenate an equally shaped tensor from every rank along dim 0, in rank order."""
    if not _many(group):
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=_group(group))
    return torch.cat(parts, dim=0)


def all_gather_ragged(values: torch.Tensor, group=None) -> torch.Tensor:
    """Concatenate every rank's 1-D `values` (lengths may differ), in rank order. Two collectives: the lengths,
    then the values padded to the longest."""
    if not _many(group):
        return values
    lengths = all_gather(torch.tensor([values.numel()], dtype=torch.long), group)
    longest = int(lengths.max())
    padded = torch.zeros(longest, dtype=values.dtype)
    padded[: values.numel()] = values
    gathered = all_gather(padded, group).view(-1, longest) if longest else padded.view(0, 0)
    return torch.cat([gathered[r, : int(n)] for r, n in enumerate(lengths)]) if longest else values[:0]


def all_reduce_sum(tensor: torch.Tensor, group=None) -> torch.Tensor:
    if _many(group):
        tensor = tensor.clone()
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=_group(group))
    return tensor


def all_reduce_max(tensor: torch.Tensor, group=None) -> torch.Tensor:
    if _many(group):
        tensor = tensor.clone()
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=_group(group))
    return tensor


def broadcast(tensor: torch.Tensor, src: int = 0, group=None) -> torch.Tensor:
    """In place: every rank's `tensor` becomes global rank `src`'s."""
    if _many(group):
        dist.broadcast(tensor, src=src, group=_group(group))
    return tensor


def broadcast_object(obj, src: int = 0, group=None):
    if not _many(group):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=_group(group))
    return box[0]


def all_gather_object(obj, group=None) -> List:
    if not _many(group):
        return [obj]
    out: List = [None] * world_size(group)
    dist.all_gather_object(out, obj, group=_group(group))
    return out


def reduce_metrics(metrics: Dict[str, float], weights: Optional[Dict[str, float]] = None) -> Dict[str, float]:
    """Weighted mean of each metric over ranks. `weights[name]` is how many items this rank's value averages
    (default 1). Names ending in /min or /max reduce as such. A rank may lack a metric (say, no active token in
    its micro-batches): the names are agreed first, and a missing value counts with weight 0."""
    names = sorted(set().union(*all_gather_object(sorted(metrics))))
    if not names:
        return {}
    have = torch.tensor([n in metrics for n in names])
    w = torch.tensor([float((weights or {}).get(n, 1.0)) if n in metrics else 0.0 for n in names], dtype=torch.float64)
    v = torch.tensor([float(metrics.get(n, 0.0)) for n in names], dtype=torch.float64)
    is_min = torch.tensor([n.endswith("/min") for n in names])
    is_max = torch.tensor([n.endswith("/max") for n in names])
    n = len(names)
    # one SUM collective for weighted sums and weights, one MAX collective for extremes (min as max of -v)
    summed = all_reduce_sum(torch.cat([torch.where(is_min | is_max, 0.0, v * w), w]))
    extremes = all_reduce_max(torch.where(have, torch.where(is_min, -v, v), -torch.inf))
    mean = summed[:n] / summed[n:].clamp(min=1e-12)
    out = torch.where(is_max, extremes, torch.where(is_min, -extremes, mean))
    return {name: out[i].item() for i, name in enumerate(names)}


# ---------------------------------------------------------------------------------------------- tensor-parallel engines
TP = "tensor_parallel"
TP_WORKER = "tensor_parallel_worker"  # the same blocks, for the async rollout threads (rollout/tensor_parallel.py)
_tp: Dict[str, object] = {}


def tensor_parallel_groups(size: int) -> Optional[object]:
    """Every rank calls this once (collective): groups of `size` consecutive ranks, each running one vLLM engine
    (vLLM's external_launcher makes the same blocks). Returns this rank's group; dist.TP names it afterwards."""
    if not _many(EVERYONE) or size <= 1:
        return None
    world, me = dist.get_world_size(), dist.get_rank()
    blocks = [list(range(start, start + size)) for start in range(0, world, size)]
    groups = [dist.new_group(block) for block in blocks]
    # a second set for the async rollout threads, whose traffic must never interleave the main thread's on dist.TP
    worker_groups = [dist.new_group(block) for block in blocks]
    _tp.update(
        group=groups[me // size], worker_group=worker_groups[me // size], size=size, leader=blocks[me // size][0]
    )
    return _tp["group"]


def tensor_parallel_leader() -> int:
    """Global rank of the first rank of this rank's engine (itself without tensor parallelism)."""
    return int(_tp.get("leader", rank(EVERYONE)))


def tensor_parallel_index() -> int:
    """Which engine this rank belongs to (0 without tensor parallelism)."""
    return rank(EVERYONE) // int(_tp.get("size", 1))


# ---------------------------------------------------------------------------------------------- sequence parallelism
SP = "sequence_parallel"
_sp: Dict[str, object] = {}


def sequence_parallel_groups(size: int) -> Optional[object]:
    """Every rank calls this once (collective): groups of `size` consecutive ranks that run each other's training
    forwards on shards of the sequence (sequence_parallel.py). Returns this rank's group; dist.SP names it."""
    if not _many(EVERYONE) or size <= 1:
        return None
    if _sp.get("size") == size:  # made by an earlier trainer of this process
        return _sp["group"]
    world, me = dist.get_world_size(), dist.get_rank()
    groups = [dist.new_group(list(range(start, start + size))) for start in range(0, world, size)]
    _sp.update(group=groups[me // size], size=size, first=me // size * size)
    return _sp["group"]


def sequence_parallel_rank_of(member: int) -> int:
    """The global rank of member `member` of this rank's sequence-parallel group."""
    return int(_sp.get("first", 0)) + member


# ---------------------------------------------------------------------------------------------- side groups
def side_group(timeout_s: float):
    """A gloo group over the training ranks with a timeout of its own, for a side thread's collectives (the weight
    sync's prefetching worker): collectives of two threads must not share one group. Collective to create: every
    rank of the world calls it, in the same order."""
    if not is_initialized():
        return None
    ranks = list(range(num_trainers())) if is_split() else None
    return dist.new_group(ranks=ranks, backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))


def monitored_barrier(reason: str, group, timeout_s: float) -> None:
    """A barrier that, when it times out, names the ranks that never arrived (gloo's monitored barrier): raised as
    TimeoutError with `reason`."""
    if group is None or dist.get_world_size(group) <= 1:
        return
    try:
        dist.monitored_barrier(group=group, timeout=datetime.timedelta(seconds=timeout_s), wait_all_ranks=True)
    except RuntimeError as exc:
        raise TimeoutError(f"{reason}: {exc}") from None


def one_host(group=None) -> bool:
    """Whether every rank of the group runs on this host (they can share memory)."""
    if not _many(group):
        return True
    return len(set(all_gather_object(socket.gethostname(), group))) == 1


# ---------------------------------------------------------------------------------------------- shared counters
def counter_store(prefix: str):
    """A key-value store shared by every rank (atomic `add`), or None without a process group: the rendezvous
    store torch.distributed already runs (TCPStore at MASTER_ADDR:MASTER_PORT), through a client connection of
    its own. The async rollout worker thread uses it while the training thread's collectives use the process
    group's, and sharing one client socket between the two threads hung training (measured: ZeRO-3's first
    forward deadlocked)."""
    if not is_initialized():
        return None
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if host and port:
        client = dist.TCPStore(
            host, int(port), is_master=False, timeout=datetime.timedelta(minutes=5), wait_for_workers=False
        )
    else:  # the address is unknown: the default store itself
        client = compat.default_store()
    return dist.PrefixStore(prefix, client)


class GroupChannel:
    """broadcast / broadcast_plain over one of the named groups (dist.WEIGHTS), the interface weight streaming uses
    (the peers are this job's own ranks)."""

    def __init__(self, group):
        self.group = group

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        return broadcast(tensor, src=src, group=self.group)

    def broadcast_plain(self, obj, src: int):
        return broadcast_object(obj, src=src, group=self.group)


# ---------------------------------------------------------------------------------------------- standalone groups
class Communicator:
    """A process group of its own between processes that share no torch.distributed world (training rank 0 and the
    ranks of a `dsgrpo vllm-serve` server): gloo on CPU, NCCL on GPU, over a key-value store (`rendezvous_store`),
    in the namespace `name`. Only broadcasts: weights flow one way."""

    def __init__(self, store, name: str, rank: int, world: int, timeout_s: float = 300):
        self.rank, self.world = rank, world
        self.group = compat.standalone_group(
            device.dist_backend(),
            dist.PrefixStore(f"dsgrpo/weights/{name}/", store),
            rank,
            world,
            datetime.timedelta(seconds=timeout_s),
        )

    @staticmethod
    def rendezvous_store(host: str, port: int, is_master: bool, timeout_s: float = 300, bind: Optional[str] = None):
        """The store a Communicator meets in. The master keeps one per port for its life and every group gets a new
        namespace: a second store on the same port can share it (SO_REUSEPORT) and take half the connections. The
        master listens on `bind` (default `host`) alone, through a socket bound here and handed to the store:
        TCPStore by itself listens on every interface."""
        listen_fd = None
        if is_master:
            address = bind or host
            family = socket.AF_INET6 if ":" in address else socket.AF_INET
            listen_fd = socket.create_server((address, port), family=family, backlog=128, reuse_port=True).detach()
        return dist.TCPStore(
            host,
            port,
            is_master=is_master,
            timeout=datetime.timedelta(seconds=timeout_s),
            wait_for_workers=False,
            master_listen_fd=listen_fd,
        )

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        self.group.broadcast([tensor], compat.broadcast_options(src)).wait()
        return tensor

    def broadcast_plain(self, obj, src: int, max_bytes: int = 64 << 20):
        """Plain data (JSON's types) from `src`: this channel crosses the network, so what arrives is parsed as
        JSON, never unpickled, and its size is checked before anything is allocated for it."""
        import json

        data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8) if self.rank == src else None
        size = self.broadcast(torch.tensor([data.numel() if data is not None else 0], dtype=torch.long), src)
        if not 0 < int(size[0]) <= max_bytes:
            raise ValueError(f"the weight channel announced a {int(size[0])}-byte message (at most {max_bytes})")
        if data is None:
            data = torch.empty(int(size[0]), dtype=torch.uint8)
        self.broadcast(data, src)
        return obj if self.rank == src else json.loads(data.numpy().tobytes().decode("utf-8"))
