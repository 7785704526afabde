"""Issue 28: sequence parallelism (DeepSpeed's Ulysses attention over a group of both ranks) trains exactly as two
data-parallel ranks do on the same rollouts: per-token log-probs, losses and gradients (through SGD's parameter
changes) for grpo, dapo, dr_grpo and GSPO, beta > 0, num_iterations 2, LoRA, a 20-step run and the
asynchronous trainer. One launch of
tests/dist_scripts/sp_checks.py. (Without the Ulysses attention each shard attends only to its own tokens: the
same check then differs by 3.5e-4 in the parameters, 7e-3 in the gradients.)"""

import json

import pytest

from launch import part, torchrun

pytestmark = pytest.mark.dist

LR = 0.05
GRAD_TOL = 1e-5


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("sp")
    torchrun("tests/dist_scripts/sp_checks.py", str(out), nproc=2, timeout=900)
    return [json.load(open(out / f"result-{r}.json")) for r in range(2)]


@pytest.mark.parametrize("name", ["grpo_ref_iterations", "dapo", "dr_grpo", "gspo", "lora", "twenty_steps", "async"])
def test_a_sequence_parallel_group_trains_as_data_parallel_ranks_do(results, name):
    for run in part(results, name):
        plain, sharded = run["plain"], run["sharded"]
        assert (plain["sp"], sharded["sp"]) == (1, 2)
        lr = 0.5 if name == "lora" else 0.02 if name == "twenty_steps" else LR
        assert run["param_diff"] / lr <= GRAD_TOL, run["worst"]
        assert sharded["steps"] == plain["steps"] == (20 if name == "twenty_steps" else 3)
        assert sharded["loss"] == pytest.approx(plain["loss"], abs=1e-5)
        assert sharded["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-5, abs=1e-7)
        assert sharded["entropy"] == pytest.approx(plain["entropy"], abs=1e-5)
        assert len(plain["logps"]) == len(sharded["logps"])  # old-policy and reference log-probs, token by token
        for a, b in zip(plain["logps"], sharded["logps"]):
            assert len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) <= 1e-5
        if name in ("grpo_ref_iterations", "gspo", "lora", "async"):
            assert plain["logps"]  # those runs computed old or reference log-probs on shards


def test_the_knobs_and_what_is_refused(results):
    for run in part(results, "knobs"):
        assert run["ds_config_size"] == 2  # the DeepSpeed config's sequence_parallel_size
        assert "token_budget=0" in run["padded"] and "Leave token_budget unset" in run["padded"]
        assert "world divisible" in run["three"] and "2 ranks" in run["three"]
        assert "cp_size=2" in run["cp"] and "set cp_size=1" in run["cp"]
        assert "Two sequence-parallel sizes" in run["disagree"]
