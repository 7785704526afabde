"""Ranks end with their launcher (issue 53): users who run `deepspeed --num_gpus N` themselves keep DeepSpeed's
runner, which on one node passes no SIGTERM on to its node launcher, so the ranks kept running after the runner
was terminated. A rank now follows the runner (its watcher, compat.deepspeed_runner_above) and its parent (the
kernel's parent-death signal, set in dist.init): a SIGTERM to the runner, or a SIGKILL to torchrun, leaves no rank.
Both launches side by side."""

import os
import signal
import subprocess
import sys
import time

import pytest

from launch import REPO, free_port, side_by_side

pytestmark = pytest.mark.dist
SCRIPT = os.path.join(REPO, "tests", "dist_scripts", "idle_ranks.py")


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def start_then_kill(launcher, sig, tmp_path):
    """Start 2 idle ranks under `launcher`, send it `sig` once both are ready; (rank pids, seconds until the last
    rank was gone or None, output)."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    path = tmp_path / f"{launcher[0]}.log"
    with open(path, "ab") as log:  # (appending: every process writes at the end, whoever reads it meanwhile)
        proc = subprocess.Popen([sys.executable, "-m", *launcher, SCRIPT], env=env, stdout=log,
                                stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
    pids, deadline = {}, time.time() + 120
    try:
        while len(pids) < 2 and time.time() < deadline and proc.poll() is None:
            time.sleep(0.2)
            pids = {int(w[1]): int(w[2]) for w in (line.split() for line in open(path)) if len(w) == 3 and w[0] == "READY"}
        assert len(pids) == 2, f"{launcher[0]}: the ranks did not start\n{open(path).read()[-3000:]}"
        os.kill(proc.pid, sig)
        killed, gone = time.time(), None
        while time.time() - killed < 15:
            if not any(alive(p) for p in pids.values()):
                gone = time.time() - killed
                break
            time.sleep(0.1)
        time.sleep(0.5)  # (what the ranks' watchers said)
        return pids, gone, open(path).read()
    finally:
        for pid in pids.values():  # whatever happened, leave nothing behind
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher's own session (start_new_session): its helpers
        except ProcessLookupError:
            pass
        proc.wait()


def test_ranks_end_with_deepspeeds_runner_and_with_torchrun(tmp_path):
    runner = ["deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(free_port())]
    torchrun = ["torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())]
    (ds_pids, ds_gone, ds_out), (tr_pids, tr_gone, tr_out) = side_by_side(
        lambda: start_then_kill(runner, signal.SIGTERM, tmp_path),
        lambda: start_then_kill(torchrun, signal.SIGKILL, tmp_path))
    assert ds_gone is not None and ds_gone < 5, (ds_gone, ds_out[-3000:])
    assert "ends with its launcher" in ds_out, ds_out[-3000:]
    assert tr_gone is not None and tr_gone < 5, (tr_gone, tr_out[-3000:])
