"""Issue 65's table: the habits of public code-RL data (tests/test_sandbox_fidelity.py's `_habit_rows`: exit(), the
test's own objects, big integers, shared interpreter state, identity and aliasing, introspection, a NamedTuple with
methods), each honest program and its wrong twin scored by a sandbox and by plain Python, side by side.

    .venv/bin/python bench/sandbox_habits.py                       # this checkout's sandbox
    git archive 691cedb dsgrpo/rewards/sandbox | tar -x -C /tmp/old
    .venv/bin/python bench/sandbox_habits.py --sandbox /tmp/old/dsgrpo/rewards/sandbox   # another one

Python's score is the fidelity suite's (the program, the setup and one test in one fresh namespace; a stdin/stdout
case as a script). Prints a line per row and `RESULT rows_at_python_score=N/M` last (~1 minute on 2 cores)."""

import argparse
import os
import sys
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import test_sandbox_fidelity as fidelity  # noqa: E402
from rewards import load_sandbox  # noqa: E402

GROUPS = (
    ["exit()"] * 7
    + ["test's objects"] * 9
    + ["big integers"]
    + ["shared state"] * 3
    + ["identity, aliasing"] * 7
    + ["introspection"] * 2
    + ["NamedTuple"]
)


def score(reward, program: str, row: dict):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return reward([f"```python\n{program}```"], [row["tests"]], test_setup_code=[row["setup"]])[0]
        except Exception as exc:  # noqa: BLE001 - an older sandbox's own failure, shown in its row
            return f"raised {type(exc).__name__}"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sandbox", help="a sandbox package directory to score with instead of dsgrpo's")
    a = parser.parse_args()
    sandbox = load_sandbox(a.sandbox)
    sandbox.check_isolation()
    reward = sandbox.CodeReward(workers=2)
    rows = fidelity._habit_rows()
    assert len(rows) == len(GROUPS), (len(rows), len(GROUPS))
    equal = 0
    for group, row in zip(GROUPS, rows):
        got = [
            (fidelity.python_score(p, row["tests"], row["setup"]), score(reward, p, row))
            for p in (row["program"], row["wrong"])
        ]
        same = all(python == sandbox_score for python, sandbox_score in got)
        equal += same
        lines = row["program"].strip().splitlines()
        label = next(
            (x for x in lines if x.startswith(("def ", "class ", "print", "history", "saved", "store"))), lines[0]
        )
        shown = "   ".join(
            f"{kind}: python {p:.2f} sandbox {s if isinstance(s, str) else f'{s:.2f}'}"
            for kind, (p, s) in zip(("honest", "wrong"), got)
        )
        print(f"{'ok ' if same else 'BAD'} {group:19s} {label[:40]:40s} {shown}")
    print(f"RESULT rows_at_python_score={equal}/{len(rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
