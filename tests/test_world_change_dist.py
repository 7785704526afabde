"""Resuming on another number of ranks (issue 30): real ZeRO-3 + vLLM runs of tests/dist_scripts/world_change_run.py.

    A   2 ranks, 6 steps uninterrupted (checkpoints 2, 4, 6): the reference
    B   1 rank, resumes A/checkpoint-2 (converted to DeepSpeed's universal format by itself), stops after step 4
    C   2 ranks with CPU offload, resumes B/checkpoint-4 (where a killed conversion left debris), trains to 6
    LoRA with deepspeed "auto" (ZeRO-2 here), AsyncGRPOTrainer: 2 ranks for 2 steps, then 1 rank resumes

At each resume the fp32 parameters, both Adam moments, lr and step equal the writing run's (max |Δ| <= 1e-6), the
chain trains each round on the reference's prompts, and its weights follow the uninterrupted run's."""

import json
import os
import shutil
from collections import Counter

import pytest
import torch

from launch import side_by_side, torchrun

pytestmark = pytest.mark.dist
SCRIPT = "tests/dist_scripts/world_change_run.py"


def run(out, *args, nproc):
    return torchrun(SCRIPT, str(out), *args, nproc=nproc, timeout=600)


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    root = tmp_path_factory.mktemp("world")
    a, b, c = root / "A", root / "B", root / "C"
    run(a, nproc=2)
    said_b = run(b, "--resume", str(a / "checkpoint-2"), "--stop-at", "4", nproc=1).stderr
    debris = b / "checkpoint-4" / ".engine_universal.partial"
    debris.mkdir()
    (debris / "half_written.pt").write_bytes(b"\0" * 100)  # a conversion killed half-way
    said_c = run(c, "--resume", str(b / "checkpoint-4"), "--variant", "offload", nproc=2).stderr
    return {"A": a, "B": b, "C": c, "said_B": said_b, "said_C": said_c}


def largest_difference(x: dict, y: dict) -> dict:
    assert x["params"].keys() == y["params"].keys() and x["params"]
    worst = {}
    for name, kinds in x["params"].items():
        for kind, value in kinds.items():
            worst[kind] = max(worst.get(kind, 0.0), (value - y["params"][name][kind]).abs().max().item())
    return worst


def state(path):
    return torch.load(path, weights_only=False)


def assert_resumed_exactly(written, resumed):
    w, r = state(written), state(resumed)
    assert (r["lr"], r["global_steps"]) == (w["lr"], w["global_steps"])
    worst = largest_difference(w, r)
    assert set(worst) == {"fp32", "exp_avg", "exp_avg_sq"} and max(worst.values()) <= 1e-6, worst
    assert max(v["exp_avg_sq"].abs().max().item() for v in w["params"].values()) > 0  # moments really were there


def test_two_ranks_to_one_and_back_resume_parameters_and_adam_moments_exactly(chain):
    assert_resumed_exactly(chain["A"] / "state_step2.pt", chain["B"] / "state_begin.pt")  # 2 → 1
    assert_resumed_exactly(chain["B"] / "state_step4.pt", chain["C"] / "state_begin.pt")  # 1 → 2, with offload


def prompts_by_round(folder, rounds):
    out = {}
    for line in open(folder / "prompts.jsonl"):
        record = json.loads(line)
        if record["round"] in rounds:
            out.setdefault(record["round"], Counter()).update(record["prompts"])
    return out


def test_the_chain_trains_the_reference_prompts_and_follows_its_weights(chain):
    a, b, c = chain["A"], chain["B"], chain["C"]
    reference = prompts_by_round(a, range(6))
    got = {**prompts_by_round(a, range(2)), **prompts_by_round(b, range(2, 4)), **prompts_by_round(c, range(4, 6))}
    assert got == reference  # no prompt twice, none skipped, across two epochs and two world-size changes
    assert all(sum(n.values()) == 8 for n in got.values())  # 4 prompts × 2 completions a round
    # the same prompts, sampling seeds and weights: the continued runs track the uninterrupted one
    for folder, step in ((b, 4), (c, 6)):
        worst = largest_difference(state(a / f"state_step{step}.pt"), state(folder / f"state_step{step}.pt"))
        assert worst["fp32"] <= 1e-4, (step, worst)
    moved = largest_difference(state(c / "state_begin.pt"), state(c / "state_step6.pt"))
    assert moved["fp32"] > 1e-4  # and C really trained
    steps = [r["step"] for r in json.load(open(c / "rows.json"))]
    assert steps == [1, 2, 3, 4, 5, 6]  # the log history carried over through both resumes


def test_conversion_is_automatic_checksummed_once_and_said_once(chain):
    from dsgrpo.checkpoint_integrity import CHECKSUMS, damage

    for written, said, old, new in (
        (chain["A"] / "checkpoint-2", chain["said_B"], 2, 1),
        (chain["B"] / "checkpoint-4", chain["said_C"], 1, 2),
    ):
        universal = written / "engine_universal"
        assert (universal / CHECKSUMS).is_file() and damage(str(universal)) is None
        assert not (written / ".engine_universal.partial").exists()  # C's debris was removed, not used
        assert not (written / "latest_universal").exists()
        assert said.count("converting") == 1, said[-3000:]
        note = [line for line in said.splitlines() if f"written by {old} rank(s), on {new}" in line]
        assert len(note) == 1, said[-3000:]
        assert "Adam moments" in note[0] and "Not exact: " in note[0] and "RNG" in note[0]
    assert "rank 1's RNG state is not used" in chain["said_B"]
    assert "rank 1 had no RNG state" in chain["said_C"]


def test_lora_with_zero2_and_the_async_trainer_resume_on_one_rank(tmp_path):
    def two_then_one(variant):
        two, one = tmp_path / f"{variant}2", tmp_path / f"{variant}1"
        run(two, "--variant", variant, "--stop-at", "2", nproc=2)
        run(one, "--variant", variant, "--resume", str(two / "checkpoint-2"), "--stop-at", "4", nproc=1)
        return variant, two, one

    # the two chains side by side: their 1-rank resumes each keep one core busy
    chains = side_by_side(lambda: two_then_one("lora"), lambda: two_then_one("async"))
    for variant, two, one in chains:  # lora runs with deepspeed "auto": ZeRO-2 here (the plan fits whole weights)
        assert_resumed_exactly(two / "state_step2.pt", one / "state_begin.pt")
        if variant == "lora":
            assert all("lora_" in name for name in state(one / "state_begin.pt")["params"])
            # the plan's choice for two ranks, kept in the checkpoint
            assert (
                json.load(open(two / "checkpoint-2" / "trainer_state.json"))["deepspeed_auto"]["deepspeed"]
                == "zero2.json"
            )
        elif variant == "async":
            saved = [json.load(open(two / "checkpoint-2" / f"rollout_state_{r}.json")) for r in (0, 1)]
            pooled = sorted(g["position"] for s in saved for g in s["pool"])
            assert pooled and json.load(open(one / "pool_begin.json")) == pooled  # both ranks' pools, on one
            trained = [p for f in (two, one) for line in open(f / "trained_positions.jsonl") for p in json.loads(line)]
            assert sorted(trained) == list(range(16)), trained  # 4 rounds × 4 groups: each group trained once


def test_a_damaged_or_half_made_universal_copy_and_a_changed_round_are_refused(chain, tmp_path):
    from datasets import Dataset

    from dsgrpo import GRPOConfig, GRPOTrainer
    from dsgrpo.checkpoint import CHECKSUMS, CheckpointError
    from dsgrpo.testing import tiny_model

    written = tmp_path / "checkpoint-2"
    shutil.copytree(chain["A"] / "checkpoint-2", written)

    def trainer(**kw):
        base = dict(
            output_dir=str(tmp_path / "out"),
            per_device_train_batch_size=8,
            num_generations=2,
            seed=3,
            max_steps=6,
            use_vllm=False,
            gradient_checkpointing=False,
            resume_from_checkpoint=str(written),
        )
        return GRPOTrainer(
            tiny_model("qwen2"),
            lambda prompts, completions, **k: [0.0] * len(completions),
            args=GRPOConfig(**{**base, **kw}),
            train_dataset=Dataset.from_list([{"prompt": "x"}] * 8),
        )

    with pytest.raises(
        CheckpointError,
        match=r"prompts_per_round: checkpoint 4, this run 2.*per_device_train_batch_"
        r"size × gradient_accumulation_steps = 8",
    ):
        trainer(per_device_train_batch_size=4)
    with pytest.raises(CheckpointError, match="sync_ref_model"):
        trainer(sync_ref_model=True, beta=0.1)
    universal = written / "engine_universal"
    moment = sorted(universal.glob("zero/*/exp_avg.pt"))[0]
    size = moment.stat().st_size
    with open(moment, "r+b") as fh:
        fh.truncate(size // 2)
    name = moment.relative_to(universal)
    with pytest.raises(
        CheckpointError,
        match=f"{universal}, the copy of the engine state converted for another world "
        f"size, is damaged: {name} has {size // 2} bytes, {size} were written",
    ):
        trainer()
    os.remove(universal / CHECKSUMS)  # as a conversion killed before its checksums (or one made by hand) leaves it
    with pytest.raises(CheckpointError, match=f"it has no {CHECKSUMS}.*Remove {universal} and resume again"):
        trainer()
    assert not (tmp_path / "out").exists() or not any(
        p.name.startswith("checkpoint") for p in (tmp_path / "out").iterdir()
    )
