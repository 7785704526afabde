"""The CPU thread budget (device.prepare_process): the machine's cores shared among a node's ranks, and never more
threads than the cores a process may run on (a Slurm task's or a container's cpuset)."""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROBE = """
import os, sys, torch
from dsgrpo import device
n = device.prepare_process(int(sys.argv[1]), None)
print(n, torch.get_num_threads(), os.environ["OMP_NUM_THREADS"])
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 or os.cpu_count() < 2, reason="needs 2 cores")
def test_thread_budget_is_bounded_by_the_cpuset():
    """On one core of this machine (taskset, as a cpuset would), a lone rank runs one thread, not os.cpu_count();
    with the machine's cores, one rank takes them all and two ranks share them."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["DS_ACCELERATOR"] = "cpu"
    first = sorted(os.sched_getaffinity(0))[0]
    cores = len(os.sched_getaffinity(0))

    def probe(local_world, cpus=None):
        cmd = [sys.executable, "-c", PROBE, str(local_world)]
        out = subprocess.run((["taskset", "-c", cpus] if cpus else []) + cmd, env=env, cwd=REPO,
                             capture_output=True, text=True, timeout=120, check=True)
        return out.stdout.strip().splitlines()[-1]

    assert probe(1, cpus=str(first)) == "1 1 1"
    if cores == os.cpu_count():  # the whole machine is this process's
        assert probe(1) == f"{cores} {cores} {cores}"
        assert probe(2) == f"{cores // 2} {cores // 2} {cores // 2}"
