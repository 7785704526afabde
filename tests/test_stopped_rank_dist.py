"""A stopped rank ends the job in every phase, whatever collective the survivor waits in (issue 53).

Six 2-rank runs side by side (dist_scripts/stop_run.py), each SIGSTOPping rank 1 at step 2 in one phase: in
generation and in the reward function (rank 0 waits in dsgrpo's gather of the rewards), in the training forward
(rank 0 waits in DeepSpeed's ZeRO-2 gradient reduction, allreduce_bucket, which has no timeout of its own), as the
optimizer step starts (DeepSpeed's step), in the weight sync, and in the checkpoint. Each must end within about
ddp_timeout of the stop, rank 0 with RANK_LOST_EXIT_CODE and its watcher's message naming rank 1, the phase it
stopped in and the phase rank 0 was in; the stopped rank is killed by its own watcher once the launcher's SIGTERM
is pending (torchrun would wait 30 s more).

Beside them, ranks end with their launcher: users who run `deepspeed --num_gpus N` themselves keep DeepSpeed's
runner, which on one node passes no SIGTERM on to its node launcher, so the ranks kept running after the runner was
terminated. A rank now follows the runner (its watcher, compat.deepspeed_runner_above) and its parent (the kernel's
parent-death signal, set in dist.init): a SIGTERM to the runner, or a SIGKILL to torchrun, leaves no rank."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from launch import REPO, free_port, side_by_side, torchrun

pytestmark = pytest.mark.dist
SCRIPT = "tests/dist_scripts/stop_run.py"
IDLE = os.path.join(REPO, "tests", "dist_scripts", "idle_ranks.py")
DDP_TIMEOUT = 10
# phase stopped in -> (rank 1's phase in the message, rank 0's phase while it waits, the step they name)
# (a rank stopped in the sync: rank 0 syncs its own engine, then waits in the round's end, where it used to say
# 'startup': the agreement on what follows a round ran outside any phase)
# (the step is the heartbeat's, optimizer steps done: 1 while step 2 is made, 2 once its update is done)
PHASES = {
    "generate": ("generate", "reward", 1),
    "reward": ("reward", "reward", 1),
    "reduce": ("train", "train", 1),
    "step": ("train", "train", 1),
    "sync": ("sync", "round end", 2),
    "checkpoint": ("checkpoint", "checkpoint", 2),
}


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
        proc = subprocess.Popen(
            [sys.executable, "-m", *launcher, IDLE],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            start_new_session=True,
        )
    pids, deadline = {}, time.time() + 120
    try:
        while len(pids) < 2 and time.time() < deadline and proc.poll() is None:
            time.sleep(0.2)
            pids = {
                int(w[1]): int(w[2]) for w in (line.split() for line in open(path)) if len(w) == 3 and w[0] == "READY"
            }
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


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    root = tmp_path_factory.mktemp("stopped")

    def run(phase):
        def launch():
            # the collectives wait DEEPSPEED_TIMEOUT (launch's 3 minutes): only the watcher can end them in time
            proc = torchrun(
                SCRIPT, str(root / phase), phase, timeout=240, check=False, env={"STOP_DDP_TIMEOUT": str(DDP_TIMEOUT)}
            )
            return proc, time.time()

        return launch

    runner = ["deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(free_port())]
    torchrun_ = ["torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())]
    launcher_kills = (
        lambda: start_then_kill(runner, signal.SIGTERM, root),
        lambda: start_then_kill(torchrun_, signal.SIGKILL, root),
    )
    *ended, by_runner, by_torchrun = side_by_side(*(run(p) for p in PHASES), *launcher_kills)
    return {**dict(zip(PHASES, ended)), "runner": by_runner, "torchrun": by_torchrun}


@pytest.mark.parametrize("phase", list(PHASES))
def test_a_stopped_rank_ends_the_job_naming_it_and_its_phase(stopped, phase):
    proc, ended = stopped[phase]
    err = proc.stdout + proc.stderr
    fault = re.search(r"^FAULT rank 1 stops in \w+ t=([\d.]+)$", err, re.M)
    said = re.search(r"^dsgrpo: error: (lost rank 1 .*)$", err, re.M)
    assert fault and said, f"{phase}: no stop or no message\n{err[-4000:]}"
    report = said.group(1)
    lost_in, waited_in, step = PHASES[phase]
    assert report.startswith("lost rank 1 (pid ") and f"in phase '{lost_in}' at step {step}" in report, report
    assert "the process is stopped (SIGSTOP" in report, report
    assert f"This rank (0) was in phase '{waited_in}' at step {step}" in report, report
    assert re.search(r"exitcode\s*:\s*3 ", err) and "finished: the stop did not end" not in err, err[-3000:]
    seconds = ended - float(fault.group(1))
    assert DDP_TIMEOUT - 2 <= seconds <= DDP_TIMEOUT + 10, (phase, seconds)


def test_ranks_end_with_deepspeeds_runner_and_with_torchrun(stopped):
    _, gone, out = stopped["runner"]  # SIGTERM to `deepspeed --num_gpus 2`
    assert gone is not None and gone < 5, (gone, out[-3000:])
    assert "ends with its launcher" in out, out[-3000:]
    _, gone, out = stopped["torchrun"]  # SIGKILL to torchrun
    assert gone is not None and gone < 5, (gone, out[-3000:])
