"""Score untrusted code: the completion's program against a row's tests, in a sandbox it cannot forge, crash,
reach past or leave.

Under RL the policy is an adversary of its own reward, so nothing the program says about itself is believed, and
nothing a test does with the program's answers may reach further than the program itself could. One run:

    judge.py       the trainer's side: starts the supervisor, compares stdin/stdout outputs, counts
    supervisor.py  S, trusted: builds the run, enforces its limits, receives the verdicts
    program.py     P, contained: the completion's code; answers questions with plain data
    checker.py     C, contained like P: the test snippets, one process per test, asking P
    answers.py     what a test gets of P's answers (the answer rule), in C
    names.py       which names the tests take from P: a pure function of the row
    containment.py namespaces, root, identity of a contained process (a "cell")
    limits.py      rlimits and the seccomp filters
    cgroups.py     the run's cgroups: memory, processes and CPU time as the kernel counts them
    protocol.py    frames, and the plain data that answers are made of
    sharing.py     what one interpreter shares across the boundary: random/decimal state, containers that crossed

The README's "Running code the policy wrote" section states the threat model. Everything here is standard library
only: the supervisor runs under `python -I -S` and tests load this package on its own.
"""

from .judge import (
    ISOLATION_MODES,
    OPT_OUT,
    CodeReward,
    SandboxLimits,
    SandboxError,
    SandboxUnavailableError,
    check_isolation,
    code_reward,
    extract_code,
    outputs_match,
    run_tests,
)

__all__ = [
    "CodeReward",
    "SandboxLimits",
    "SandboxError",
    "SandboxUnavailableError",
    "check_isolation",
    "code_reward",
    "extract_code",
    "outputs_match",
    "run_tests",
    "ISOLATION_MODES",
    "OPT_OUT",
]
