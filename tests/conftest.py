"""Shared fixtures. Multi-process tests are marked `dist` (2 ranks, real DeepSpeed/vLLM); the quick unit
suite is `pytest -m "not dist and not slow"`."""

import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("DSGRPO_CACHE", os.path.join(REPO, ".cache", "dsgrpo"))
os.environ.setdefault("DSGRPO_VERIFY_WEIGHT_SYNC", "checksum")  # every weight sync in the suite is checked (issue 45)


@pytest.fixture(scope="session")
def tiny_qwen():
    from dsgrpo.testing import tiny_model

    return tiny_model("qwen2")


@pytest.hookimpl(trylast=True)  # after -m/-k have deselected
def pytest_collection_modifyitems(session, config, items):
    """The quick tier first, then the launches and the slow ones (each group in file order): a broken change fails
    within minutes, and the preparations of tests/background.py run beside the unit tests."""
    items.sort(key=lambda item: any(item.get_closest_marker(m) for m in ("dist", "slow")))


def pytest_collection_finish(session):
    import background

    background.start_needed([item.nodeid for item in session.items])


def pytest_sessionfinish(session):
    import background

    background.stop_all()


_SECONDS_BY_FILE: dict = {}


def pytest_runtest_logreport(report):
    test_file = report.nodeid.split("::")[0]
    _SECONDS_BY_FILE[test_file] = _SECONDS_BY_FILE.get(test_file, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    """How many 2-rank launches the run made and where their seconds went, beside --durations' slowest tests:
    the suite's budget is mostly launches (issue 47)."""
    from collections import defaultdict
    from launch import LAUNCHES

    if len(_SECONDS_BY_FILE) > 1:
        terminalreporter.write_sep("=", "seconds by test file (setup + call + teardown)")
        for test_file, seconds in sorted(_SECONDS_BY_FILE.items(), key=lambda kv: -kv[1])[:30]:
            terminalreporter.write_line(f"{seconds:7.1f}s  {test_file}")
    if not LAUNCHES:
        return
    by_file = defaultdict(lambda: [0, 0.0])
    for test_file, _, seconds in LAUNCHES:
        by_file[test_file][0] += 1
        by_file[test_file][1] += seconds
    total = sum(s for _, _, s in LAUNCHES)
    terminalreporter.write_sep("=", f"{len(LAUNCHES)} launches, {total:.0f} s")
    for test_file, (count, seconds) in sorted(by_file.items(), key=lambda kv: -kv[1][1]):
        terminalreporter.write_line(f"{seconds:7.1f}s {count:3d} launches  {test_file}")
