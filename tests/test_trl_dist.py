"""TRL users' settings end to end on 2 ranks (real DeepSpeed ZeRO-3, real in-process vLLM, fp32 CPU). One launch of
tests/dist_scripts/trl_checks.py records numbers; each test asserts on one part of them."""

import json
import math

import pytest

from launch import part, torchrun

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("trl_checks")
    torchrun("tests/dist_scripts/trl_checks.py", str(out), timeout=1200)
    return [json.load(open(out / f"result-{r}.json")) for r in range(2)]


def test_later_steps_of_a_round_train_off_policy(results):
    for run in part(results, "several_steps"):
        for name in ("num_iterations", "steps_per_generation"):
            rows = run[name]
            assert [h["step"] for h in rows] == [2, 4], (name, rows)  # two optimizer steps per round
            # the first step of a round is on-policy (ratio 1); after it π_old ≠ π_θ, so some ratio is clipped
            assert max(h["clip_ratio/region_mean"] for h in rows) > 0, (name, rows)
            assert all(math.isfinite(h["loss"]) for h in rows)


def test_an_optimizer_step_accumulates_across_rounds(results):
    for run in part(results, "accumulation_across_rounds"):
        assert run["rounds"] == [2, 1] and run["steps"] == [1, 1]  # two rounds fed the one step of the first run
        assert run["moved"] > 1e-3  # SGD at lr 1: the weights move by the gradient itself
        assert run["max_diff"] <= 1e-6, run  # the same accumulated gradient


def test_steps_epochs_and_accumulation_are_counted_as_trl_counts_them(results):
    for run in part(results, "trl_step_counts"):
        assert run["calls"] == 48 and run["steps"] == run["max_steps"] == 18 and run["rounds"] == 6, run
        assert run["windows"] == [3, 3, 3, 3, 3, 1] * 3, run  # an epoch's last step takes what is left
        assert abs(run["epoch"] - 3.0) < 1e-9
        assert run["last_lr"] == 0.0 and run["lrs"][0] > run["lrs"][-2] > 0  # linear decay ends at step 18


LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "grpo/sequence", "sapo", "luspo/sequence", "vespo"]


def test_every_loss_type_trains_end_to_end(results):
    for run in part(results, "loss_types"):
        rows = run["history"]
        assert len(rows) == len(LOSS_TYPES)
        for name, h, moved in zip(LOSS_TYPES, rows, run["moved"]):
            assert math.isfinite(h["loss"]) and math.isfinite(h["grad_norm"]) and h["grad_norm"] > 0, (name, h)
            assert moved > 1e-4, (name, moved)  # the weights changed in that round
            assert h["kl"] >= 0, (name, h)
            kind = name.split("/")[0]
            if kind == "cispo":
                assert "cispo_clip_ratio" in h and "clip_ratio/region_mean" not in h
            elif kind == "sapo":
                assert not any(k.startswith("clip_ratio") or k == "cispo_clip_ratio" for k in h)
            elif kind == "vespo":
                assert 0 < h["vespo/phi_seq_mean"] <= 1.5
            else:
                assert 0 <= h["clip_ratio/region_mean"] <= 1


def test_truncated_completions_leave_the_loss(results):
    for run in part(results, "mask_truncated"):
        seen = [
            (t, n, c) for m in run["masks"] for t, n, c in zip(m["truncated"], m["row_tokens"], m["completion_tokens"])
        ]
        assert any(t for t, _, _ in seen)
        for truncated, kept, tokens in seen:
            assert kept == (0.0 if truncated else tokens)


def test_generation_kwargs_override_sampling_fields(results):
    for run in part(results, "generation_kwargs"):
        assert run["top_k"] == 1
        assert run["history"][0]["frac_reward_zero_std"] == 1.0  # top_k=1: a group's completions are identical


def test_structured_outputs_constrain_every_completion(results):
    for run in part(results, "structured_outputs"):
        h = run["history"][0]
        assert h["reward"] == 1.0 and h["completions/max_length"] <= 4  # three digits (and the end token)


def test_chat_template_kwargs_reach_the_template(results):
    for run in part(results, "chat_template_kwargs"):
        assert run["prompt"].endswith("<|im_start|>assistant\nSure: ") and run["steps"] == 1


def test_schedule_save_strategy_epoch_and_fractional_logging(results):
    from transformers import get_scheduler
    import torch

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    ref = get_scheduler(
        "cosine_with_min_lr",
        opt,
        num_warmup_steps=2,
        num_training_steps=5,
        scheduler_specific_kwargs={"min_lr_rate": 0.1},
    )
    expected = []
    for _ in range(5):  # logged after the scheduler stepped, as TRL logs it: the rate of the next step
        opt.step(), ref.step()
        expected.append(ref.get_last_lr()[0])
    run = part(results, "schedule")[0]
    assert run["lr"] == pytest.approx(expected, rel=1e-9)  # warm-up over 0.4 of the run, then cosine to 0.1·lr
    assert run["epochs"] == [0.5, 1.0, 1.5, 2.0, 2.5]  # 8 prompts, 4 a round
    assert run["checkpoints"] == ["checkpoint-2", "checkpoint-4"]  # save_strategy="epoch"
    assert run["logged_steps"] == [2, 4, 5]  # logging_steps=0.4 of 5 = every 2, and the last


def test_save_only_model_writes_a_model_and_refuses_to_resume(results):
    run = part(results, "save_only_model")[0]
    assert "model.safetensors" in run["files"] and "engine" not in run["files"]
    assert "save_only_model=True" in run["refused"] and "Start a new run" in run["refused"]


def test_train_resume_from_checkpoint_true(results):
    for run in part(results, "resume_via_train"):
        assert run["resumed_at"].endswith("checkpoint-2")
        assert run["steps"] == [1, 2, 3]  # steps 1-2 restored from the checkpoint's history, 3 trained
        s = run["summary"]
        assert s["step"] == 3 and s["train_runtime"] > 0 and math.isfinite(s["train_loss"])


def test_sync_ref_model_mixes_the_reference(results):
    for run in part(results, "sync_ref_model"):
        assert run["moved"] > 1e-3  # the policy moved, so the mix is not trivially exact
        assert run["max_diff"] <= 1e-6, run


def test_adaptive_entropy_control(results):
    for run in part(results, "adaptive_entropy"):
        rows = run["history"]
        assert [round(h["entropy_coef"], 6) for h in rows] == [0.01, 0.02, 0.03]
        # step 1 has no measured entropy yet: no bonus; later steps subtract coef · entropy
        assert rows[0]["loss"] == pytest.approx(rows[0]["policy_loss"], abs=1e-6)
        for prev, h in zip(rows, rows[1:]):
            assert h["loss"] == pytest.approx(h["policy_loss"] - prev["entropy_coef"] * h["entropy"], abs=2e-3)


def test_the_entropy_quantile_is_one_threshold_over_all_ranks(results):
    a, b = (r["thresholds"] for r in part(results, "entropy_quantile"))
    assert len(a) == 2 and a == b  # one per micro-batch, the same on both ranks (TRL gathers the entropies)


def test_the_trainer_surface_trl_users_call(results):
    for rank, run in enumerate(part(results, "surface")):
        seen = run["seen"]
        assert seen == {
            "model": "Qwen2ForCausalLM",
            "tokenizer": "Qwen2Tokenizer",
            "optimizer": True,
            "scheduler": "LambdaLR",
            "args": "GRPOConfig",
            "epoch": 0.125,
        }
        assert "dropped_ran" not in seen and run["model_is_module"]
        evals = run["evals"]
        assert len(evals) == 1 and {"eval_small_reward", "eval_other_reward"} <= set(evals[0])
        assert run["summary"]["step"] == 2 and "train_loss" in run["summary"]
    main = part(results, "surface")[0]
    assert main["completion_ranks"] == [0, 1]  # every rank's rows reach the completion log
    # at logging steps only, as TRL (logging_steps=2 of 2): unique prompts, 4 of the round logged, 8 at the evaluation
    assert main["completion_rows"] == 4 + 8 and main["completion_steps"] == [2]


def test_model_init_kwargs_reach_every_model_and_unused_columns_are_removed(results):
    for run in part(results, "model_kwargs"):
        assert run["policy"] == run["reference"] == run["reward_model"] == "eager"
        assert run["reward_kwargs"] == ["completion_ids", "trainer_state"]  # remove_unused_columns: no idx column


def test_a_streamed_train_set_resumes_exactly(results):
    runs = part(results, "streaming")
    for rank, run in enumerate(runs):
        # 6 rows, 4 prompts a round: round 2 wraps into the second pass; rank r holds half of each round
        assert run["idx"] == [[0, 1], [4, 5], [2, 3]] if rank == 0 else run["idx"] == [[2, 3], [0, 1], [4, 5]]
        assert run["resumed_idx"] == run["idx"][2:]  # resumed at checkpoint-2: round 2's rows again
