"""Issue 53's figures for the code sandbox, counted rather than asserted: the hostile-program corpus
(tests/sandbox_attacks.py, held = scored at most the honest wrong answer and left nothing behind), the answer
forgers (tests/sandbox_answer_attacks.py, held = at most their honest wrong twin) and the fidelity suite
(tests/test_sandbox_fidelity.py, equal = the sandbox's score is plain Python's, for the honest programs and for
their wrong twins).

    .venv/bin/python bench/sandbox_figures.py          # ~3 minutes on 2 cores
"""

from __future__ import annotations

import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

from dsgrpo.rewards import sandbox  # noqa: E402

import sandbox_answer_attacks as answer_attacks  # noqa: E402
import sandbox_attacks as attacks  # noqa: E402
import test_sandbox  # noqa: E402
import test_sandbox_fidelity as fidelity  # noqa: E402


def held(row) -> bool:
    try:
        test_sandbox.check_row(row)
        return True
    except AssertionError as failure:
        print("  NOT HELD:", failure)
        return False


def main() -> None:
    sandbox.check_isolation()
    with tempfile.TemporaryDirectory() as work:
        rows = list(attacks.run_corpus(sandbox, work))
    hostile = [r for r in rows if r["name"] != "honest" and not r["name"].startswith("baseline")]
    print(f"hostile programs (tests/sandbox_attacks.py): {sum(map(held, hostile))} held / {len(hostile)}")

    reward = sandbox.CodeReward(limits=fidelity.LIMITS, workers=2)
    rows = answer_attacks.scored(reward)
    forged = [name for name, forger, wrong in rows if forger > wrong]
    print(
        f"answer forgers (tests/sandbox_answer_attacks.py): {len(rows) - len(forged)} held / {len(rows)}"
        + (f"  forged: {forged}" if forged else "")
    )

    scored = fidelity.scored.__wrapped__()
    for honest, what in ((True, "honest programs"), (False, "wrong twins")):
        part = [r for r in scored if r["honest"] is honest]
        equal = sum(r["sandbox"] == r["python"] for r in part)
        print(f"fidelity, {what} (tests/test_sandbox_fidelity.py): {equal} equal to Python / {len(part)}")


if __name__ == "__main__":
    main()
