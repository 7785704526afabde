"""The tree passes `make lint` (ruff.toml: pyflakes' and pycodestyle's checks): an unused import, an undefined name
or a stray tab fails the quick tier, not a reviewer."""

import os
import subprocess
import sys

from launch import REPO


def test_the_tree_passes_ruff():
    ruff = os.path.join(os.path.dirname(sys.executable), "ruff")
    assert os.path.exists(ruff), "ruff is not installed: make setup (requirements/cpu-lock.txt pins it)"
    out = subprocess.run(
        [ruff, "check", "--no-cache", "--output-format", "concise", "."],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
