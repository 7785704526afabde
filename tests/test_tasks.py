"""The demo's task (dsgrpo/tasks.py): its held-out set, its reward, and the state its warm-up leaves the model in —
what makes the demo a sharpening run (issue 54) rather than a search."""

import json
import os

import pytest

from dsgrpo import tasks


def test_the_held_out_numbers_are_distinct_and_never_in_the_training_set():
    train = set(tasks.copy_digits_dataset()["answer"])
    held = list(tasks.copy_digits_heldout()["answer"])
    assert len(held) == 200 == len(set(held)) and not set(held) & train
    assert all(len(x) == 3 and x.isdigit() for x in held)
    assert held == list(tasks.copy_digits_heldout()["answer"])      # the same set every time
    with pytest.raises(ValueError, match="only 1 3-digit|ask for fewer"):
        tasks.copy_digits_heldout(10 ** 3)


def test_the_warm_ups_wrong_answer_scores_nothing():
    assert tasks.off_by_one("384") == "495" and tasks.off_by_one("909") == "010"
    assert tasks.copy_digits_reward(["495", "384", "394", "no"], ["384"] * 4) == [0.0, 1.0, 2 / 3, 0.0]


@pytest.mark.slow
def test_the_warm_up_leaves_a_model_that_copies_sometimes_and_never_greedily(tmp_path, monkeypatch, capsys):
    """About one digit in five right when sampled, none greedily (its greedy answer is the off-by-one); the CLI keeps
    a model built by the same recipe and rebuilds one built by another."""
    out = str(tmp_path / "init")
    assert tasks.main(["warmup", "--out", out]) == 0
    start = tasks.evaluate_copy(out, n=100)
    assert start["greedy_pass@1"] <= 0.02 and start["greedy_reward"] <= 0.05, start
    assert 0.08 <= start["sampled_reward"] <= 0.35, start
    with open(os.path.join(out, "warmup.json")) as fh:
        assert json.load(fh) == tasks.WARMUP_RECIPE
    stamp = os.path.getmtime(os.path.join(out, "model.safetensors"))
    assert tasks.main(["warmup", "--out", out]) == 0                   # same recipe: kept
    assert os.path.getmtime(os.path.join(out, "model.safetensors")) == stamp
    built = []
    monkeypatch.setattr(tasks, "copy_warmup", lambda base, out, **kw: built.append(kw))
    os.remove(os.path.join(out, "warmup.json"))                        # an older demo's model (no recipe): rebuilt
    assert tasks.main(["warmup", "--out", out]) == 0
    assert built == [{"steps": 150, "copy_fraction": 0.2}] and "another warm-up recipe" in capsys.readouterr().out
