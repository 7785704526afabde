"""Memory of a stdin/stdout row with many cases that each print ~1 MiB (issue 53): the supervisor's peak RSS (it
used to keep every case's stdout until the row ended, then send them hex-encoded in one JSON result) and the
trainer's peak RSS growth while it scores the row (it decoded them all at once).

    .venv/bin/python bench/sandbox_stdout_memory.py [--cases 60] [--sandbox DIR]

--sandbox loads another copy of dsgrpo/rewards/sandbox/ (e.g. an older commit's, exported with `git archive`) to
measure it the same way. Prints one line per figure; run it on an otherwise quiet machine (the row takes ~5 s).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time


def peak_rss_kib() -> int:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmHWM:"))


def load(directory: str | None):
    if directory is None:
        from dsgrpo.rewards import sandbox

        return sandbox
    spec = importlib.util.spec_from_file_location(
        "bench_sandbox", os.path.join(directory, "__init__.py"), submodule_search_locations=[directory]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_sandbox"] = module
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=60)
    parser.add_argument("--sandbox", default=None, help="a copy of the sandbox package to measure instead")
    args = parser.parse_args()
    sandbox = load(args.sandbox)
    # each case prints 1,000,000 bytes (500,000 tokens), the right answer: every output is compared
    program = "import sys\nn = int(input())\nsys.stdout.write(f'{n % 10} ' * 500_000)\n"
    cases = [{"input": f"{i}\n", "output": f"{i % 10} " * 500_000} for i in range(args.cases)]
    sandbox.check_isolation()
    before = peak_rss_kib()
    figures: dict = {}
    start = time.perf_counter()
    score = sandbox.run_tests(program, cases, sandbox.SandboxLimits(), figures=figures)
    seconds = time.perf_counter() - start
    print(f"cases: {args.cases} x 1,000,000 bytes of stdout; score {score} in {seconds:.1f} s")
    print(f"supervisor peak RSS: {figures['supervisor_maxrss_kib'] / 1024:.1f} MiB")
    print(f"trainer peak RSS growth: {(peak_rss_kib() - before) / 1024:.1f} MiB")


if __name__ == "__main__":
    main()
