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
        out = subprocess.run(
            (["taskset", "-c", cpus] if cpus else []) + cmd,
            env=env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        return out.stdout.strip().splitlines()[-1]

    assert probe(1, cpus=str(first)) == "1 1 1"
    if cores == os.cpu_count():  # the whole machine is this process's
        assert probe(1) == f"{cores} {cores} {cores}"
        assert probe(2) == f"{cores // 2} {cores // 2} {cores // 2}"


HEAP_PROBE = """
import resource, sys, torch
from dsgrpo import device
if sys.argv[1] == "kept":
    assert device.keep_freed_heap()
sizes = [3, 5, 9, 14, 20, 7, 11, 2]  # MiB: a step's transients of mixed sizes, all freed at its end
def step():
    held = [torch.ones(m * 2**18) for m in sizes]
    del held
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def test_freed_heap_is_kept_between_steps():
    """glibc's defaults give a step's freed transients back to the OS, so the next step faults (and zeroes) pages
    again; with keep_freed_heap they stay. 10 steps of 71 MiB (18,200 pages each): by default 18,500 to 117,000
    faults here, depending on where other allocations landed (so only the kept side is a bound); kept 768 to 5,120
    (now and then one block is faulted again once). The bound: the ten steps together fault fewer pages than one."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    faults = {
        mode: int(
            subprocess.run(
                [sys.executable, "-c", HEAP_PROBE, mode],
                env=env,
                cwd=REPO,
                capture_output=True,
                text=True,
                timeout=120,
                check=True,
            ).stdout.split()[-1]
        )
        for mode in ("default", "kept")
    }
    assert faults["kept"] < 18_200, faults  # fewer than one step's 71 MiB, over all ten
    assert faults["kept"] <= faults["default"], faults


def test_a_users_glibc_settings_are_left_alone(monkeypatch):
    from dsgrpo import device

    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=1000")
    assert device.keep_freed_heap() is False
    monkeypatch.delenv("GLIBC_TUNABLES")
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "1000")
    assert device.keep_freed_heap() is False
