"""An ecosystem's own virtual environment (issue 66): built with pip from a pinned requirements file the project
ships (requirements/envs/NAME.txt) or the user names, on first use, and cached by the file's hash and the Python
version, so a changed pin builds a new one and an unchanged one is never rebuilt. Ranks that share a machine (or a
cache on a shared file system) build it once: the others wait on a file lock. `dsgrpo env-host build NAME` builds it
ahead of time (e.g. on a login node, where compute nodes have no registry)."""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

READY = ".dsgrpo-ready"  # written last: a folder without it is a build that died, rebuilt from scratch


def shipped_requirements() -> Path:
    return Path(__file__).resolve().parents[2] / "requirements" / "envs"


def requirements_file(name_or_path: str) -> Path:
    """`verifiers` → the shipped requirements/envs/verifiers.txt; a path → that file."""
    path = Path(name_or_path)
    if path.suffix == ".txt" or os.sep in name_or_path:
        if not path.is_file():
            raise FileNotFoundError(f"env host: requirements file {name_or_path!r} does not exist")
        return path.resolve()
    shipped = shipped_requirements() / f"{name_or_path}.txt"
    if not shipped.is_file():
        known = sorted(p.stem for p in shipped_requirements().glob("*.txt"))
        raise FileNotFoundError(
            f"env host: no requirements for the ecosystem {name_or_path!r} (shipped: {known}); "
            "pass the path of a pinned requirements file instead"
        )
    return shipped


def cache_root() -> Path:
    return Path(os.environ.get("DSGRPO_ENV_CACHE") or Path.home() / ".cache" / "dsgrpo" / "envs")


def venv_dir(requirements: Path) -> Path:
    digest = hashlib.sha256(requirements.read_bytes() + sys.version.split()[0].encode()).hexdigest()[:16]
    return cache_root() / f"{requirements.stem}-{digest}"


def venv_python(folder: Path) -> Path:
    return folder / "bin" / "python"


def ensure_venv(name_or_path: str, log=print) -> Path:
    """The interpreter of the ecosystem's venv, built now if no finished one is cached."""
    requirements = requirements_file(name_or_path)
    folder = venv_dir(requirements)
    if (folder / READY).exists():
        return venv_python(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another rank may be building it: wait, then use its build
        if (folder / READY).exists():
            return venv_python(folder)
        shutil.rmtree(folder, ignore_errors=True)
        start = time.time()
        log(f"dsgrpo: building the {requirements.stem} environment in {folder} (first use; cached after)")
        subprocess.run([sys.executable, "-m", "venv", str(folder)], check=True)
        pip = [str(venv_python(folder)), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
        done = subprocess.run(pip + ["-r", str(requirements)], capture_output=True, text=True)
        if done.returncode:
            tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-15:])
            raise RuntimeError(f"env host: pip could not build {folder} from {requirements}:\n{tail}")
        (folder / READY).write_text(f"{requirements}\n{time.time() - start:.1f} s\n")
        log(f"dsgrpo: built the {requirements.stem} environment in {time.time() - start:.0f} s")
    return venv_python(folder)
