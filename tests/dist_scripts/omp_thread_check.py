"""Started without OMP_NUM_THREADS (as the deepspeed launcher starts a rank): the main thread takes its share of
the cores (device.prepare_process), then a background thread generates, with and without
compat.engine_thread_threads. Prints one JSON line: what each thread's generate gave (ids or the error)."""

import json
import os
import sys
import threading

import torch

from dsgrpo import GRPOConfig, compat, device

device.prepare_process(2)
from dsgrpo.rollout.base import SamplingConfig  # noqa: E402
from dsgrpo.rollout.vllm_engine import VLLMGenerator  # noqa: E402
from dsgrpo.testing import tiny_model  # noqa: E402

args = GRPOConfig(output_dir=sys.argv[1], max_completion_length=4, report_to=[])
generator = VLLMGenerator(tiny_model("qwen2"), args, dtype=torch.float32)
sampling = SamplingConfig.from_args(args)
out = {"main": generator.generate([[1, 5, 6, 7]], [1], sampling).completion_ids[0]}


def generate(name, fix):
    if fix:
        compat.engine_thread_threads(torch.get_num_threads())
    try:
        out[name] = generator.generate([[1, 5, 6, 7, 9]], [1], sampling).completion_ids[0]
    except Exception as exc:  # noqa: BLE001 - recorded for the test
        out[name] = str(exc)[:300]


for name, fix in (("set", True), ("unset", False)):  # a refused call leaves the engine unusable: it goes last
    t = threading.Thread(target=generate, args=(name, fix), daemon=True)
    t.start()
    t.join(timeout=120)
print(json.dumps(out), flush=True)
os._exit(0)
