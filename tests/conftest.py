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
