"""The GPU lock: requirements/gpu-lock.txt, every package of a CUDA install pinned, resolved from requirements/gpu.in.

    python requirements/gpu_lock.py lock     # re-resolve gpu.in and write the lock (`make lock-gpu`)
    python requirements/gpu_lock.py check    # the lock still resolves, unchanged, and matches compat.TESTED

Both run pip's own resolver as a CUDA machine's pip would (`pip install --dry-run --report` for Linux x86_64 and
CPython 3.11 wheels, reading package metadata only: no CUDA, no GPU, nothing installed), in isolated mode so this
machine's local wheels (torch 2.13.0+cpu) and constraints are not seen. deepspeed is an sdist that needs torch to
build its metadata, so it stays out of the resolution: its Requires-Dist (read from the DeepSpeed installed here, the
same release) must name only packages the lock pins."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from typing import Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, "gpu.in")
LOCK = os.path.join(HERE, "gpu-lock.txt")
PYTHON_VERSION = "3.11"
# pip takes a target platform literally: every manylinux tag a current x86_64 Linux accepts is listed
PLATFORMS = [f"manylinux_2_{v}_x86_64" for v in range(17, 40)] + [
    "manylinux2014_x86_64",
    "manylinux2010_x86_64",
    "manylinux1_x86_64",
    "linux_x86_64",
]
BUILT_AT_INSTALL = ("deepspeed",)  # sdists: installed by `make setup-gpu` after the rest, without build isolation
HEADER = """\
# Every package of the CUDA (GPU) environment, pinned: pip's resolution of requirements/gpu.in for Linux x86_64,
# CPython {python}. Install with `make setup-gpu`; regenerate with `make lock-gpu`; CI checks it with
# `python requirements/gpu_lock.py check` (tests/test_gpu_lock.py). The versions of torch, vllm, deepspeed,
# transformers and peft are dsgrpo/compat.py's TESTED.
"""


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_lines(path: str) -> List[str]:
    """A requirements file's requirement lines, comments and blanks left out."""
    lines = [line.split("#", 1)[0].strip() for line in open(path)]
    return [line for line in lines if line]


def name_of(requirement: str) -> str:
    return canonical(re.split(r"[<>=!~ ;\[(]", requirement, 1)[0])


def read_pins(path: str) -> Dict[str, str]:
    """{canonical name: version} of a file of `name==version` lines."""
    pins = {}
    for line in requirement_lines(path):
        name, _, version = line.partition("==")
        if not version:
            raise ValueError(f"{path}: '{line}' is not pinned (name==version)")
        pins[canonical(name)] = version.strip()
    return pins


def resolve(requirements: List[str], timeout: int = 1500) -> Dict[str, str]:
    """{canonical name: version} pip would install for these requirement lines on a CUDA Linux machine."""
    with tempfile.TemporaryDirectory() as tmp:
        req = os.path.join(tmp, "requirements.txt")
        with open(req, "w") as fh:
            fh.write("\n".join(requirements) + "\n")
        report = os.path.join(tmp, "report.json")
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "--isolated",
            "install",
            "--dry-run",
            "--ignore-installed",
            "--quiet",
            "--report",
            report,
            "--only-binary=:all:",
            "--python-version",
            PYTHON_VERSION,
            "--implementation",
            "cp",
            "--target",
            os.path.join(tmp, "target"),
            "-r",
            req,
        ]
        for platform in PLATFORMS:
            cmd += ["--platform", platform]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if out.returncode:
            raise RuntimeError(f"pip could not resolve the GPU requirements:\n{out.stderr[-4000:]}")
        items = json.load(open(report))["install"]
    return {canonical(i["metadata"]["name"]): i["metadata"]["version"] for i in items}


def source_lines() -> List[str]:
    return [line for line in requirement_lines(SOURCE) if name_of(line) not in BUILT_AT_INSTALL]


def built_at_install() -> Dict[str, str]:
    """{name: version} of gpu.in's pins that pip cannot resolve here (sdists, installed last)."""
    return {
        name_of(line): line.partition("==")[2]
        for line in requirement_lines(SOURCE)
        if name_of(line) in BUILT_AT_INSTALL
    }


def untested(pins: Dict[str, str]) -> Dict[str, str]:
    """The lock's versions of compat.TESTED's packages that are not the tested ones (missing ones included)."""
    sys.path.insert(0, os.path.dirname(HERE))
    from dsgrpo import compat

    locked = {name: pins.get(canonical(name), "missing") for name in compat.TESTED}
    return compat.untested_versions(locked)


def deepspeed_requirements_missing(pins: Dict[str, str]) -> List[str]:
    """deepspeed's unconditional Requires-Dist (from the release installed here) that the lock does not pin."""
    from importlib import metadata

    if metadata.version("deepspeed") != pins.get("deepspeed"):
        raise RuntimeError(
            f"deepspeed {metadata.version('deepspeed')} is installed here, the lock pins "
            f"{pins.get('deepspeed')}: check against the same release"
        )
    names = [name_of(r) for r in metadata.requires("deepspeed") or [] if "extra ==" not in r]
    return [n for n in names if n not in pins]


def lock() -> int:
    pins = {**resolve(source_lines()), **built_at_install()}
    with open(LOCK, "w") as fh:
        fh.write(HEADER.format(python=PYTHON_VERSION))
        for name in sorted(pins):
            fh.write(f"{name}=={pins[name]}\n")
    print(f"wrote {LOCK}: {len(pins)} packages")
    return 0


def check() -> int:
    """0 when the lock pins compat.TESTED's versions, deepspeed's requirements, and is exactly what pip resolves
    from it for a CUDA machine (nothing added, nothing moved); 1 with what differs."""
    pins = read_pins(LOCK)
    problems = []
    bad = untested(pins)
    if bad:
        problems.append(f"versions that are not compat.TESTED's: {bad}")
    missing = deepspeed_requirements_missing(pins)
    if missing:
        problems.append(f"deepspeed needs packages the lock does not pin: {missing}")
    wanted = {n: v for n, v in pins.items() if n not in BUILT_AT_INSTALL}
    got = resolve([f"{n}=={v}" for n, v in sorted(wanted.items())])
    if got != wanted:
        extra = {n: v for n, v in got.items() if n not in wanted}
        moved = {n: (wanted[n], got[n]) for n in wanted if n in got and got[n] != wanted[n]}
        dropped = sorted(n for n in wanted if n not in got)
        problems.append(
            f"pip's resolution of the lock differs from it: added {extra}, moved {moved}, not installed {dropped}"
        )
    for line in problems:
        print(f"gpu-lock: {line}", file=sys.stderr)
    if not problems:
        print(
            f"gpu-lock: {len(pins)} packages resolve unchanged for Linux x86_64 / CPython {PYTHON_VERSION}; "
            f"tested versions: "
            + ", ".join(
                f"{n} {pins[canonical(n)]}"
                for n in sorted(pins)
                if n in ("torch", "vllm", "deepspeed", "transformers", "peft")
            )
        )
    return 1 if problems else 0


if __name__ == "__main__":
    command = sys.argv[1] if len(sys.argv) > 1 else ""
    if command not in ("lock", "check"):
        print(__doc__)
        sys.exit(2)
    sys.exit(lock() if command == "lock" else check())
