"""The GPU install (requirements/gpu-lock.txt, `make setup-gpu`) cannot drift from what dsgrpo was tested with: its
versions are compat.TESTED's, and pip's resolver, run as on a CUDA machine (metadata only), installs exactly the
lock. No GPU is needed for either; the second reads the package registry."""

import importlib.util
import os
import sys

import pytest

from dsgrpo import compat

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location("gpu_lock", os.path.join(REPO, "requirements", "gpu_lock.py"))
gpu_lock = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_lock)


def test_the_lock_pins_the_tested_versions_and_what_deepspeed_needs():
    pins = gpu_lock.read_pins(gpu_lock.LOCK)
    assert gpu_lock.untested(pins) == {}
    assert {name: pins[name] for name in compat.TESTED} == {
        "torch": "2.13.0",
        "deepspeed": "0.19.8",
        "vllm": "0.32.0",
        "transformers": "5.19.0",
        "peft": "0.21.2",
        "bitsandbytes": "0.50.2",
    }
    assert gpu_lock.deepspeed_requirements_missing(pins) == []
    # gpu.in's own pins are the lock's: regenerate with `make lock-gpu` after changing either
    for line in gpu_lock.requirement_lines(gpu_lock.SOURCE):
        name, _, version = line.partition("==")
        if version:
            assert pins[gpu_lock.canonical(name)] == version, name


def test_a_drifted_pin_is_caught():
    pins = dict(gpu_lock.read_pins(gpu_lock.LOCK), vllm="0.33.0")
    assert gpu_lock.untested(pins) == {"vllm": "0.33.0"}
    del pins["hjson"]
    assert gpu_lock.deepspeed_requirements_missing(pins) == ["hjson"]


def start_resolve(folder):
    """`gpu_lock.py check` in a process of its own (tests/background.py starts it beside the unit tests)."""
    import background

    return background.command([sys.executable, os.path.join(REPO, "requirements", "gpu_lock.py"), "check"], folder)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_pip_resolves_the_lock_unchanged_for_a_cuda_machine():
    import background

    proc = background.result("gpu_lock_resolve")
    assert proc.returncode == 0 and "resolve unchanged" in proc.stdout, proc.stderr[-4000:]
