"""Launching 2-rank scripts from tests: a hard timeout on every launch and a low DEEPSPEED_TIMEOUT, so a hang
fails fast instead of eating CI's budget."""

import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCHES: list = []  # (test file, script, seconds) of every launch: conftest prints where the suite's time goes


def free_port() -> int:
    """A port nothing listens on now. 29500 + pid % 1000 could give two launches on one machine (a suite and a
    developer's run beside it) the same rendezvous port; a full-disk test failed on a gloo timeout while another
    2-rank job ran."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(
    script: str, *args: str, nproc: int = 2, timeout: int = 600, env: dict | None = None, check: bool = True
) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--master_port",
        str(free_port()),
        os.path.join(REPO, script),
        *args,
    ]
    full_env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "DEEPSPEED_TIMEOUT": "3",
        "DS_ACCELERATOR": "cpu",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "PYTHONPATH": REPO,
        "DSGRPO_VERIFY_WEIGHT_SYNC": "checksum",  # every sync of every test is checked (issue 45)
        **(env or {}),
    }
    full_env = {k: v for k, v in full_env.items() if v is not None}  # env={NAME: None} unsets NAME
    start = time.perf_counter()
    test_file = os.environ.get("PYTEST_CURRENT_TEST", "?").split("::")[0]
    try:
        proc = subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(
            f"{script} did not finish within {timeout} s (a hang?)\n{(exc.stderr or '')[-4000:]}"
        ) from None
    finally:
        LAUNCHES.append((test_file, script, time.perf_counter() - start))
    if check and proc.returncode != 0:
        raise AssertionError(f"{script} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def side_by_side(*launches):
    """Run independent launches at once (each a function of no arguments) and return their results in order; the
    first failure is raised once all have ended. For launches that leave a core idle: a 1-rank launch keeps one of
    the 2 cores busy, so beside another launch it costs about half its time."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=len(launches)) as pool:
        running = [pool.submit(launch) for launch in launches]
    return [done.result() for done in running]  # (the with block waited for all)


def rank_results(out, nproc: int = 2) -> list:
    """What each rank of a checks script wrote: OUT/result-<rank>.json, in rank order."""
    import json

    return [json.load(open(os.path.join(str(out), f"result-{r}.json"))) for r in range(nproc)]


def part(results: list, name: str) -> list:
    """Check `name`'s record on every rank; fails the test with the rank's traceback when the check raised."""
    import pytest

    ranks = []
    for r, res in enumerate(results):
        if name not in res:
            pytest.fail(f"check {name} recorded nothing on rank {r}")
        if isinstance(res[name], dict) and "error" in res[name]:
            pytest.fail(f"check {name} failed on rank {r}:\n{res[name]['error']}")
        ranks.append(res[name])
    return ranks
