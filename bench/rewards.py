"""Rewards per second of the built-in rewards on real data, and of code_reward's sandbox.

    .venv/bin/python bench/rewards.py [--gsm8k ../shared/data/gsm8k/test.jsonl] [--repeat 3] [--code-rows 64]
    .venv/bin/python bench/rewards.py --only code --sandbox /tmp/old_sandbox/sandbox.py  # another one, side by side

code_reward's workloads: `honest` (small MBPP-like functions, each row 3-4 asserts, half the rows wrong),
`stdio` (the same as stdin/stdout programs, 3 cases a row) and `timeouts` (programs that never end, killed at a
1 s limit). A sandbox file without CodeReward (an older one) is timed through its run_tests, row after row, as
its code_reward ran. Prints one line per workload and `RESULT ...` lines last."""

import argparse
import importlib.util
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROBLEMS = [  # (right solution, wrong solution, asserts, stdin/stdout program, cases)
    (
        "def add(a, b):\n    return a + b\n",
        "def add(a, b):\n    return a - b\n",
        ["assert add(1, 2) == 3", "assert add(0, 0) == 0", "assert add(-5, 5) == 0"],
        "a, b = map(int, input().split())\nprint(a + b)\n",
        [("1 2", "3"), ("0 0", "0"), ("-5 5", "0")],
    ),
    (
        "def rev(s):\n    return s[::-1]\n",
        "def rev(s):\n    return s\n",
        ["assert rev('abc') == 'cba'", "assert rev('') == ''", "assert rev('ab') == 'ba'"],
        "print(input()[::-1])\n",
        [("abc", "cba"), ("x", "x"), ("ab", "ba")],
    ),
    (
        "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
        "def fib(n):\n    return n\n",
        ["assert fib(0) == 0", "assert fib(10) == 55", "assert [fib(i) for i in range(6)] == [0, 1, 1, 2, 3, 5]"],
        "n = int(input())\na, b = 0, 1\nfor _ in range(n):\n    a, b = b, a + b\nprint(a)\n",
        [("0", "0"), ("10", "55"), ("20", "6765")],
    ),
    (
        "import math\ndef is_prime(n):\n    return n > 1 and all(n % d for d in range(2, math.isqrt(n) + 1))\n",
        "def is_prime(n):\n    return n % 2 == 1\n",
        [
            "assert is_prime(2)",
            "assert not is_prime(9)",
            "assert [n for n in range(20) if is_prime(n)] == [2, 3, 5, 7, 11, 13, 17, 19]",
            "assert is_prime(7919)",
        ],
        "import math\nn = int(input())\nprint(n > 1 and all(n % d for d in range(2, math.isqrt(n) + 1)))\n",
        [("2", "True"), ("9", "False"), ("7919", "True")],
    ),
]


def code_workload(rows: int, kind: str):
    completions, tests = [], []
    for i in range(rows):
        right, wrong, asserts, script, cases = PROBLEMS[i % len(PROBLEMS)]
        if kind == "honest":
            completions.append(f"```python\n{right if i % 2 == 0 else wrong}```")
            tests.append(asserts)
        elif kind == "stdio":
            completions.append(f"```python\n{script}```")
            tests.append([{"input": a + "\n", "output": b} for a, b in cases])
        else:  # timeouts
            completions.append("```python\nwhile True:\n    pass\n```")
            tests.append(asserts)
    return completions, tests


def load_sandbox(path):
    if path is None:
        from dsgrpo.rewards import sandbox

        return sandbox
    if os.path.isdir(path):  # a copy of the sandbox package (dsgrpo/rewards/sandbox/)
        spec = importlib.util.spec_from_file_location(
            "bench_sandbox", os.path.join(path, "__init__.py"), submodule_search_locations=[path]
        )
    else:  # a single-file sandbox.py of before the package (its runner beside it)
        spec = importlib.util.spec_from_file_location("bench_sandbox", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_sandbox"] = module
    spec.loader.exec_module(module)
    return module


def code_reward_for(sandbox, timeout_s: float):
    limits = sandbox.SandboxLimits(timeout_s=timeout_s, cpu_s=max(1, int(timeout_s)))
    if hasattr(sandbox, "CodeReward"):
        return sandbox.CodeReward(limits=limits)

    def sequential(completions, tests):  # an older sandbox: its code_reward, row after row
        return [sandbox.run_tests(sandbox.extract_code(c), t, limits) for c, t in zip(completions, tests)]

    return sequential


def bench_code(a) -> dict:
    sandbox = load_sandbox(a.sandbox)
    results = {}
    for kind in ("honest", "stdio", "timeouts"):
        if kind == "stdio" and not hasattr(sandbox, "outputs_match"):
            continue
        rows = a.code_rows if kind != "timeouts" else max(2, a.code_rows // 8)
        completions, tests = code_workload(rows, kind)
        reward = code_reward_for(sandbox, 1.0 if kind == "timeouts" else 5.0)
        best, scores = float("inf"), None
        for _ in range(a.repeat):
            t = time.perf_counter()
            scores = reward(completions, tests)
            best = min(best, time.perf_counter() - t)
        results[kind] = rows / best
        print(
            f"code_reward {kind:9s} {rows} completions in {best:.3f} s = {results[kind]:,.1f} /s "
            f"(mean score {sum(scores) / len(scores):.3f})"
        )
    return results


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--gsm8k", default=os.path.join(REPO, "..", "shared", "data", "gsm8k", "test.jsonl"))
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--code-rows", type=int, default=64)
    p.add_argument("--only", choices=("math", "code"), default=None)
    p.add_argument(
        "--sandbox",
        default=None,
        help="a sandbox package directory, or an older single-file sandbox.py, to time instead of dsgrpo's",
    )
    a = p.parse_args()
    results = {}
    if a.only != "code":
        from dsgrpo.rewards import accuracy_reward, think_format_reward

        rows = [json.loads(line) for line in open(a.gsm8k)]
        solutions = [r["answer"] for r in rows]
        # completions as a model would write them: the reasoning, then the final line (half of them wrong)
        completions = [s if i % 2 == 0 else s.rsplit("####", 1)[0] + "#### 0" for i, s in enumerate(solutions)]
        for name, fn, kwargs in (
            ("accuracy_reward", accuracy_reward, {"solution": solutions}),
            ("think_format_reward", think_format_reward, {}),
        ):
            best = float("inf")
            for _ in range(a.repeat):
                t = time.perf_counter()
                fn(completions, **kwargs)
                best = min(best, time.perf_counter() - t)
            results[name] = len(completions) / best
            print(f"{name:22s} {len(completions)} completions in {best:.3f} s = {results[name]:,.0f} rewards/s")
    if a.only != "math":
        code = bench_code(a)
    if a.only != "code":
        print(f"RESULT accuracy_reward_per_s={results['accuracy_reward']:.0f}")
    if a.only != "math":
        print("RESULT " + " ".join(f"code_reward_{k}_per_s={v:.1f}" for k, v in code.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
