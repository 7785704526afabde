"""A stopped rank ends the job in every phase, whatever collective the survivor waits in (issue 53).

Six 2-rank runs side by side (dist_scripts/stop_run.py), each SIGSTOPping rank 1 at step 2 in one phase: in
generation and in the reward function (rank 0 waits in dsgrpo's gather of the rewards), in the training forward
(rank 0 waits in DeepSpeed's ZeRO-2 gradient reduction, allreduce_bucket, which has no timeout of its own), as the
optimizer step starts (DeepSpeed's step), in the weight sync, and in the checkpoint. Each must end within about
ddp_timeout of the stop, rank 0 with RANK_LOST_EXIT_CODE and its watcher's message naming rank 1, the phase it
stopped in and the phase rank 0 was in; the stopped rank is killed by its own watcher once the launcher's SIGTERM
is pending (torchrun would wait 30 s more)."""

import re
import time

import pytest

from launch import side_by_side, torchrun

pytestmark = pytest.mark.dist
SCRIPT = "tests/dist_scripts/stop_run.py"
DDP_TIMEOUT = 10
# phase stopped in -> (rank 1's phase in the message, rank 0's phase while it waits, the step they name)
# (a rank stopped in the sync: rank 0 syncs its own engine, then waits in the round's end, where it used to say
# 'startup': the agreement on what follows a round ran outside any phase)
# (the step is the heartbeat's, optimizer steps done: 1 while step 2 is made, 2 once its update is done)
PHASES = {"generate": ("generate", "reward", 1), "reward": ("reward", "reward", 1), "reduce": ("train", "train", 1),
          "step": ("train", "train", 1), "sync": ("sync", "round end", 2), "checkpoint": ("checkpoint", "checkpoint", 2)}


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    root = tmp_path_factory.mktemp("stopped")

    def run(phase):
        def launch():
            # the collectives wait DEEPSPEED_TIMEOUT (launch's 3 minutes): only the watcher can end them in time
            proc = torchrun(SCRIPT, str(root / phase), phase, timeout=240, check=False,
                            env={"STOP_DDP_TIMEOUT": str(DDP_TIMEOUT)})
            return proc, time.time()
        return launch
    return dict(zip(PHASES, side_by_side(*(run(p) for p in PHASES))))


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
