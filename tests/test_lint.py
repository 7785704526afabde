"""The tree passes `make lint` (ruff.toml): an unused import, an undefined name, a stray tab or a file the formatter
would lay out otherwise fails the quick tier, not a reviewer."""

import os
import subprocess
import sys

from launch import REPO


def ruff(*command):
    path = os.path.join(os.path.dirname(sys.executable), "ruff")
    assert os.path.exists(path), "ruff is not installed: make setup (requirements/cpu-lock.txt pins it)"
    return subprocess.run([path, *command], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_the_tree_passes_ruff():
    out = ruff("check", "--no-cache", "--output-format", "concise", ".")
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


def test_the_tree_is_laid_out_as_the_formatter_lays_it():
    out = ruff("format", "--check", "--no-cache", ".")
    assert out.returncode == 0, "run `.venv/bin/ruff format .`:\n" + out.stdout[-4000:] + out.stderr[-2000:]
