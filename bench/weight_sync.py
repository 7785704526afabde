"""What a weight sync costs, per way of generating: seconds per sync of the policy into colocated vLLM (tensor
parallel 1 and 2) and per push to a `dsgrpo vllm-serve` server, against the bytes moved and a plain memcpy of the
same bytes (server mode also against a loopback socket copy of them), each phase's share (gather, convert, wire,
load; rollout/weight_sync.py SyncStats), the full weights a sync holds beyond the policy's own, on a real model's
shape with random bf16 weights (no download). `--zero 3` partitions the policy (ZeRO-3, every parameter sharded);
the default lets the memory plan choose (ZeRO-2 for 0.5B on a 24 GiB machine: whole weights).

    python bench/weight_sync.py [--shape qwen2.5-0.5b] [--modes colocate_tp1,colocate_tp2,server] [--repeat 3]
                                [--zero auto|3] [--path native|reload]

Each mode is one 2-rank launch (torchrun) of this file with --worker; the server mode also starts a one-rank
server. Prints one line per mode and `RESULT <mode>_s=<...> ...` last. Nothing is asserted: the figures go in
notes and issues."""

import argparse
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench.lora_sync import SHAPES  # noqa: E402

MODES = ("colocate_tp1", "colocate_tp2", "server")


def build_model(shape: str, root: str) -> str:
    """A random-init bf16 model of `shape` with the local tokenizer, saved once."""
    path = os.path.join(root, f"{shape}-random-bf16")
    if os.path.isfile(os.path.join(path, "model.safetensors")):
        return path
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from dsgrpo.testing import tiny_tokenizer

    spec = dict(SHAPES[shape])
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path + ".tmp")
    AutoTokenizer.from_pretrained(tiny_tokenizer()).save_pretrained(path + ".tmp")
    os.replace(path + ".tmp", path)
    return path


def memcpy_seconds(nbytes: int, repeat: int) -> float:
    import torch

    src, dst = torch.empty(nbytes, dtype=torch.uint8).fill_(1), torch.empty(nbytes, dtype=torch.uint8)
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return best


def worker(a) -> int:
    """One 2-rank launch: build the trainer, time `repeat` syncs."""
    import torch
    from datasets import Dataset

    from dsgrpo import GRPOConfig, GRPOTrainer, dist

    extra = dict(vllm_tensor_parallel_size=2) if a.worker == "colocate_tp2" else {}
    if a.worker == "server":
        extra = dict(vllm_mode="server", vllm_server_port=a.port, vllm_group_port=a.group_port, vllm_server_timeout=600)
    if a.zero == "3":  # every parameter partitioned (the threshold keeps small ones whole otherwise)
        config = json.load(open(os.path.join(REPO, "ds_configs", "zero3.json")))
        config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
        extra["deepspeed"] = config
    if a.path == "reload":  # vLLM's reload_weights, as before the native weight-transfer API was used
        from dsgrpo import compat

        compat.register_inprocess_weight_engine = lambda: False
    args = GRPOConfig(
        output_dir=os.path.join(a.out, a.worker),
        max_steps=1,
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=8,
        gradient_checkpointing=False,
        bf16=True,
        vllm_kv_cache_bytes=256 << 20,
        vllm_max_model_length=512,
        weight_sync_bucket_bytes=a.bucket_mb << 20,
        report_to="none",
        save_strategy="no",
        verify_weight_sync=a.verify,
        **extra,
    )
    trainer = GRPOTrainer(
        a.model,
        lambda completions, **k: [0.0] * len(completions),
        train_dataset=Dataset.from_list([{"prompt": "x"}] * 4),
        args=args,
    )
    module = trainer.policy.module
    nbytes = sum(int(getattr(p, "ds_numel", p.numel())) * p.element_size() for p in module.parameters())
    seconds, phases = [], []
    for _ in range(a.repeat):
        dist.barrier("sync timing")
        start = time.perf_counter()
        trainer.source.sync_weights(module, 0)
        dist.barrier("sync timing")
        seconds.append(time.perf_counter() - start)
        phases.append(trainer.source.sync_metrics())
    if dist.is_main():
        with open(os.path.join(a.out, f"{a.worker}.json"), "w") as fh:
            json.dump(
                {
                    "seconds": seconds,
                    "bytes": nbytes,
                    "dtype": str(next(module.parameters()).dtype),
                    "memcpy_s": memcpy_seconds(nbytes, 3),
                    "threads": torch.get_num_threads(),
                    "loopback_s": loopback_seconds(nbytes) if a.worker == "server" else None,
                    "phases": phases,
                    "zero3": any(hasattr(p, "ds_id") for p in module.parameters()),
                },
                fh,
            )
    return 0


def loopback_seconds(nbytes: int) -> float:
    """One copy of `nbytes` through a loopback TCP socket (what server mode's wire is compared with)."""
    import socket
    import threading

    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    chunk = bytearray(8 << 20)

    def sink():
        conn, _ = server.accept()
        view = memoryview(bytearray(8 << 20))
        got = 0
        while got < nbytes:
            n = conn.recv_into(view)
            if not n:
                break
            got += n
        conn.close()

    thread = threading.Thread(target=sink)
    thread.start()
    client = socket.create_connection(("127.0.0.1", port))
    start = time.perf_counter()
    sent = 0
    while sent < nbytes:
        sent += client.send(memoryview(chunk)[: min(len(chunk), nbytes - sent)])
    client.close()
    thread.join()
    seconds = time.perf_counter() - start
    server.close()
    return seconds


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--bucket-mb", type=int, default=64)
    p.add_argument("--zero", choices=("auto", "3"), default="auto")
    p.add_argument("--path", choices=("native", "reload"), default="native")
    p.add_argument("--verify", choices=("off", "checksum"), default="off")
    p.add_argument("--out", default="/tmp/dsgrpo_bench_weight_sync")
    p.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--group-port", type=int, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        return worker(a)

    from dsgrpo.testing import ServerProcess, _free_port

    os.makedirs(a.out, exist_ok=True)
    model = build_model(a.shape, a.out)
    env = dict(
        os.environ,
        OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu"),
        PYTHONPATH=REPO,
    )
    results = {}
    for mode in a.modes.split(","):
        port, group_port = _free_port(), _free_port()
        server = None
        if mode == "server":
            server = ServerProcess(
                model,
                os.path.join(a.out, "server.json"),
                port=port,
                group_port=group_port,
                dtype="bfloat16",
                extra=["--kv-cache-bytes", str(256 << 20), "--max-model-len", "512"],
            )
            server.start(timeout_s=900)
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(_free_port()),
            os.path.abspath(__file__),
            "--worker",
            mode,
            "--model",
            model,
            "--out",
            a.out,
            "--repeat",
            str(a.repeat),
            "--bucket-mb",
            str(a.bucket_mb),
            "--port",
            str(port),
            "--group-port",
            str(group_port),
            "--zero",
            a.zero,
            "--path",
            a.path,
            "--verify",
            a.verify,
        ]
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
        finally:
            if server is not None:
                server.kill()
        if proc.returncode != 0:
            print(f"{mode}: failed ({proc.returncode})\n{proc.stderr[-3000:]}", flush=True)
            continue
        r = json.load(open(os.path.join(a.out, f"{mode}.json")))
        best = min(r["seconds"])
        results[mode] = best
        print(
            f"{a.shape} {mode:13s} {r['bytes'] / 2**20:8.1f} MB ({r['dtype']}, "
            f"{'ZeRO-3' if r['zero3'] else 'whole'}): {best:6.2f} s/sync "
            f"(all: {', '.join(f'{s:.2f}' for s in r['seconds'])}), {r['bytes'] / best / 2**30:5.2f} GiB/s; "
            f"memcpy {r['memcpy_s']:.3f} s → {best / r['memcpy_s']:.1f}× memcpy"
            + (f"; loopback copy {r['loopback_s']:.3f} s → {best / r['loopback_s']:.1f}×" if r["loopback_s"] else ""),
            flush=True,
        )
        phases = r["phases"][r["seconds"].index(best)]
        if phases:
            print(
                "    phases (rank 0, best sync): "
                + ", ".join(f"{k.split('/')[1]} {v:.3f}" for k, v in phases.items() if k.endswith("_s"))
                + f"; extra memory held {phases.get('sync/peak_extra_bytes', 0) / 2**20:.0f} MiB",
                flush=True,
            )
    print("RESULT " + " ".join(f"{m}_s={s:.2f}" for m, s in results.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
