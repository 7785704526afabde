"""Reward functions that inject a fault into a `dsgrpo train` job (the Slurm chaos tests, where there is no script
of ours around the trainer): FAULT_STEP / FAULT_RANK / FAULT_SIGNAL (KILL or STOP) in the environment say when,
where and how. The fault line carries the time, so a test can bound how long the survivor took."""

import os
import signal
import time


def digits_or_fault(prompts, completions, answer, trainer_state=None, **kwargs):
    """copy_digits_reward, until the fault."""
    from dsgrpo.process_exit import say_line
    from dsgrpo.tasks import copy_digits_reward

    rank = int(os.environ.get("RANK", 0))
    if rank == int(os.environ.get("FAULT_RANK", -1)) and trainer_state.global_step == int(os.environ["FAULT_STEP"]):
        sig = getattr(signal, "SIG" + os.environ.get("FAULT_SIGNAL", "KILL"))
        say_line(f"FAULT rank {rank} {sig.name} in reward at step {trainer_state.global_step} t={time.time():.3f}")
        os.kill(os.getpid(), sig)
    return copy_digits_reward(completions, answer)
