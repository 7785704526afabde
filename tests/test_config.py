"""GRPOConfig: TRL 1.16 defaults, YAML/CLI round trips, and the validation errors (message content)."""

import os

import pytest
import yaml

from dsgrpo import GRPOConfig
from dsgrpo.config import load_deepspeed_config, parse_cli_overrides

TRL_DEFAULTS = dict(
    learning_rate=1e-6,
    num_generations=8,
    max_completion_length=512,
    temperature=1.0,
    top_p=1.0,
    top_k=0,
    min_p=None,
    repetition_penalty=1.0,
    beta=0.0,
    epsilon=0.2,
    epsilon_high=None,
    delta=None,
    loss_type="dapo",
    importance_sampling_level="token",
    scale_rewards="group",
    multi_objective_aggregation="sum_then_normalize",
    reward_weights=None,
    mask_truncated_completions=False,
    num_iterations=1,
    steps_per_generation=None,
    generation_batch_size=None,
    vllm_mode="colocate",
    vllm_gpu_memory_utilization=0.3,
    vllm_tensor_parallel_size=1,
    vllm_enable_sleep_mode=False,
    vllm_importance_sampling_correction=True,
    vllm_importance_sampling_mode="sequence_mask",
    vllm_importance_sampling_clip_max=3.0,
    logging_steps=10,
    shuffle_dataset=True,
    log_completions=False,
    seed=42,
    max_grad_norm=1.0,
    weight_decay=0.0,
    lr_scheduler_type="linear",
    warmup_ratio=0.0,
    warmup_steps=0,
    eval_strategy="no",
    num_generations_eval=None,
    max_steps=-1,
    num_train_epochs=3.0,
    per_device_train_batch_size=8,
    gradient_accumulation_steps=1,
    save_steps=500,
    save_total_limit=None,
    resume_from_checkpoint=None,
)


def test_defaults_match_trl():
    cfg = GRPOConfig()
    for name, value in TRL_DEFAULTS.items():
        assert getattr(cfg, name) == value, name
    assert cfg.effective_epsilon_high == 0.2
    assert cfg.gradient_checkpointing == "auto"  # deliberate (TRL: True): the memory planner decides
    # steps_per_generation / generation_batch_size default to gradient accumulation
    cfg = GRPOConfig(gradient_accumulation_steps=4, per_device_train_batch_size=4, num_generations=4)
    assert cfg.resolved_steps_per_generation(world_size=2) == 4
    assert cfg.resolved_generation_batch_size(world_size=2) == 32


def test_scale_rewards_accepts_booleans_like_trl():
    assert GRPOConfig(scale_rewards=True).scale_rewards_mode == "group"
    assert GRPOConfig(scale_rewards=False).scale_rewards_mode == "none"
    assert GRPOConfig(scale_rewards="batch").scale_rewards_mode == "batch"


def test_yaml_round_trip(tmp_path):
    cfg = GRPOConfig(
        beta=0.04,
        loss_type="grpo",
        reward_weights=[1.0, 0.5],
        top_k=5,
        report_to=["wandb"],
        deepspeed={"zero_optimization": {"stage": 2}},
        output_dir=str(tmp_path / "out"),
    )
    path = tmp_path / "resolved.yaml"
    cfg.save(str(path))
    assert GRPOConfig.from_yaml(str(path)) == cfg
    assert yaml.safe_load(path.read_text())["beta"] == 0.04


def test_cli_overrides_win_over_yaml(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("beta: 0.1\nnum_generations: 4\nper_device_train_batch_size: 4\n")
    cfg = GRPOConfig.from_yaml(str(path), ["--beta", "0.02", "--loss_type=bnpo", "--top-k", "null", "--bf16", "true"])
    assert (cfg.beta, cfg.loss_type, cfg.top_k, cfg.bf16, cfg.num_generations) == (0.02, "bnpo", None, True, 4)
    assert parse_cli_overrides(["--reward_weights", "[1, 2.5]"]) == {"reward_weights": [1, 2.5]}
    # YAML 1.1 reads 7e-4 as a string: numbers are still numbers for numeric fields
    cfg = GRPOConfig.from_yaml(str(path), ["--learning_rate", "7e-4"])
    assert cfg.learning_rate == 7e-4 and isinstance(cfg.learning_rate, float)
    with pytest.raises(TypeError, match="max_steps='1e2'"):  # not an integer: still refused
        GRPOConfig.from_yaml(str(path), ["--max_steps", "1e2"])


@pytest.mark.parametrize(
    "kwargs, exc, words",
    [
        ({"num_generation": 4}, TypeError, None),  # plain dataclass construction: Python's own error
        ({"num_generations": 1}, ValueError, ["num_generations=1", "at least 2"]),
        ({"loss_type": "ppo"}, ValueError, ["loss_type='ppo'", "dapo", "cispo"]),
        ({"importance_sampling_level": "seq"}, ValueError, ["importance_sampling_level", "sequence"]),
        ({"scale_rewards": "batchwise"}, ValueError, ["scale_rewards", "group"]),
        ({"vllm_importance_sampling_mode": "token"}, ValueError, ["vllm_importance_sampling_mode", "token_truncate"]),
        ({"multi_objective_aggregation": "sum"}, ValueError, ["multi_objective_aggregation", "normalize_then_sum"]),
        ({"learning_rate": "fast"}, TypeError, ["learning_rate='fast'", "float"]),
        ({"num_generations": 4.0}, TypeError, ["num_generations=4.0", "int"]),
        ({"per_device_train_batch_size": 3, "num_generations": 2}, ValueError, ["not divisible by num_generations=2"]),
        (
            {"generation_batch_size": 12, "per_device_train_batch_size": 8, "num_generations": 4},
            ValueError,
            ["generation_batch_size=12", "per_device_train_batch_size", "multiple of 8"],
        ),
        ({"generation_batch_size": 16, "steps_per_generation": 2}, ValueError, ["both set", "only one"]),
        ({"top_p": 0.0}, ValueError, ["top_p=0.0"]),
        ({"delta": 1.1}, ValueError, ["delta=1.1", "1 + epsilon_high"]),
        ({"vllm_tensor_parallel_size": 3}, ValueError, ["vllm_tensor_parallel_size=3", "divisor of the world size"]),
    ],
)
def test_validation_errors(kwargs, exc, words):
    with pytest.raises(exc) as info:
        GRPOConfig(**kwargs)
    for w in words or []:
        assert w in str(info.value), (w, str(info.value))


def test_world_size_divisibility_uses_the_launcher_world(monkeypatch):
    # 4 completions per rank, groups of 8: valid on 2 ranks (8 a step), not on 1 or 3.
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = GRPOConfig(per_device_train_batch_size=4, num_generations=8)
    cfg.validate(world_size=2)
    for world in (1, 3):
        with pytest.raises(ValueError, match=f"world size {world}.*not divisible by num_generations=8"):
            cfg.validate(world_size=world)
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ValueError, match="world size 1"):
        GRPOConfig(per_device_train_batch_size=4, num_generations=8)


def test_unknown_keys_get_a_did_you_mean(tmp_path):
    with pytest.raises(ValueError, match="Unknown config key 'num_generation'. Did you mean 'num_generations'"):
        GRPOConfig.from_dict({"num_generation": 4})
    path = tmp_path / "c.yaml"
    path.write_text("learning_rat: 1e-5\n")
    with pytest.raises(ValueError, match="Did you mean 'learning_rate'"):
        GRPOConfig.from_yaml(str(path))
    with pytest.raises(ValueError, match="Did you mean 'beta'"):
        parse_cli_overrides(["--betta", "0.1"])
    with pytest.raises(ValueError, match="has no value"):
        parse_cli_overrides(["--beta"])
    with pytest.raises(FileNotFoundError, match="does not exist"):
        GRPOConfig.from_yaml(str(tmp_path / "missing.yaml"))


def test_deepspeed_config_resolution(tmp_path):
    assert load_deepspeed_config("zero3.json")["zero_optimization"]["stage"] == 3
    assert load_deepspeed_config("zero2.json")["zero_optimization"]["stage"] == 2
    with pytest.raises(FileNotFoundError, match="deepspeed='nope.json'.*zero3.json"):
        load_deepspeed_config("nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_deepspeed_config(str(bad))


def test_an_unquoted_no_is_the_string_no_where_the_field_takes_strings():
    # YAML 1.1 reads `no` as False: `save_strategy: no` in a recipe and `--save_strategy no` on a command line
    from dsgrpo.config import parse_cli_overrides

    cfg = GRPOConfig.from_dict(
        {
            **parse_cli_overrides(["--save_strategy", "no", "--bf16", "false"]),
            **yaml.safe_load("eval_strategy: no\nlogging_strategy: no\n"),
        }
    )
    assert (cfg.save_strategy, cfg.eval_strategy, cfg.logging_strategy, cfg.bf16) == ("no", "no", "no", False)


def test_vllm_enforce_eager_auto_compiles_only_runs_long_enough_to_repay_it():
    from dsgrpo.rollout.vllm_engine import CPU_COMPILE_MIN_DECODE_STEPS, enforce_eager

    def cfg(**kw):
        return GRPOConfig(output_dir="/tmp/unused", per_device_train_batch_size=8, num_generations=8, **kw)

    assert enforce_eager(cfg(max_completion_length=512), total_steps=10) is True  # 5,120 decode steps
    assert enforce_eager(cfg(max_completion_length=512), total_steps=400) is False  # 204,800
    assert enforce_eager(cfg(max_completion_length=512), total_steps=None) is True  # unknown (a server)
    # rounds, not optimizer steps: with num_iterations 2 each round trains two steps
    steps = CPU_COMPILE_MIN_DECODE_STEPS // 100
    assert enforce_eager(cfg(max_completion_length=100), total_steps=steps) is False
    assert enforce_eager(cfg(max_completion_length=100, num_iterations=2), total_steps=steps) is True
    # an explicit value wins both ways
    assert enforce_eager(cfg(max_completion_length=512, vllm_enforce_eager=True), total_steps=400) is True
    assert enforce_eager(cfg(max_completion_length=8, vllm_enforce_eager=False), total_steps=1) is False


def test_the_best_model_fields_follow_transformers_rules():
    cfg = GRPOConfig(load_best_model_at_end=True, eval_strategy="steps", eval_steps=5, save_steps=10)
    assert cfg.metric_for_best_model == "eval_reward" and cfg.greater_is_better is True  # GRPO has no eval loss
    assert GRPOConfig(metric_for_best_model="rewards/f/mean").metric_for_best_model == "eval_rewards/f/mean"
    assert GRPOConfig(metric_for_best_model="eval_loss").greater_is_better is False
    assert GRPOConfig(metric_for_best_model="eval_reward", greater_is_better=False).greater_is_better is False
    with pytest.raises(
        ValueError, match="load_best_model_at_end=True needs evaluations at the checkpoints: eval_strategy='no'"
    ):
        GRPOConfig(load_best_model_at_end=True)
    with pytest.raises(ValueError, match="save_steps=15 must be a multiple of eval_steps=10"):
        GRPOConfig(load_best_model_at_end=True, eval_strategy="steps", eval_steps=10, save_steps=15)
    with pytest.raises(ValueError, match="eval_strategy='steps' and save_strategy='epoch'"):
        GRPOConfig(load_best_model_at_end=True, eval_strategy="steps", save_strategy="epoch")


def test_the_best_checkpoint_is_recorded_only_with_its_evaluation_and_survives_pruning(tmp_path):
    from types import SimpleNamespace

    from dsgrpo import checkpoint

    args = GRPOConfig(metric_for_best_model="reward", eval_strategy="steps")
    state = SimpleNamespace(global_step=2, best_metric=None, best_model_checkpoint=None, best_global_step=None)
    assert checkpoint.consider_best(state, args, (1, {"eval_reward": 0.9}), "ck-2") is None  # not this step's
    assert checkpoint.consider_best(state, args, (2, {"eval_reward": 0.5}), "ck-2") == (None, None, None)
    assert (state.best_metric, state.best_model_checkpoint, state.best_global_step) == (0.5, "ck-2", 2)
    state.global_step = 4
    assert checkpoint.consider_best(state, args, (4, {"eval_reward": 0.4}), "ck-4") is None  # worse: unchanged
    state.global_step = 6
    assert checkpoint.consider_best(state, args, (6, {"eval_reward": 0.7}), "ck-6") == (0.5, "ck-2", 2)
    assert state.best_model_checkpoint == "ck-6"
    lower = GRPOConfig(metric_for_best_model="eval_loss", eval_strategy="steps")
    state = SimpleNamespace(global_step=1, best_metric=0.3, best_model_checkpoint="a", best_global_step=0)
    assert checkpoint.consider_best(state, lower, (1, {"eval_loss": 0.2}), "b") and state.best_model_checkpoint == "b"
    # pruning keeps the newest save_total_limit checkpoints and the best one wherever it is
    for step in (1, 2, 3, 4):
        os.makedirs(tmp_path / f"checkpoint-{step}")
        for name in ("COMPLETE", "trainer_state.json"):
            open(tmp_path / f"checkpoint-{step}" / name, "w").close()
    checkpoint.prune(str(tmp_path), 1, keep_also=str(tmp_path / "checkpoint-2"))
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-2", "checkpoint-4"]


def test_a_best_metric_no_evaluation_logs_is_refused_naming_the_ones_it_does():
    from dsgrpo import checkpoint
    from dsgrpo.evaluation import metric_names

    args = GRPOConfig(metric_for_best_model="eval_accuracy", eval_strategy="steps")
    with pytest.raises(
        ValueError,
        match=r"metric_for_best_model='eval_accuracy' is not an evaluation metric of this "
        r"run; it logs \['eval_reward', 'eval_rewards/f/mean', 'eval_hard_reward'",
    ):
        checkpoint.check_best_metric(args, metric_names(args, ["", "hard"], ["f"]))
    with pytest.raises(ValueError, match="no eval_dataset"):
        checkpoint.check_best_metric(args, metric_names(args, [], ["f"]))
    args = GRPOConfig(metric_for_best_model="eval_hard_reward", eval_strategy="steps")
    checkpoint.check_best_metric(args, metric_names(args, ["", "hard"], ["f"]))
    args = GRPOConfig(metric_for_best_model="pass@4", eval_strategy="steps", num_generations=8, eval_pass_at_k=[1, 4])
    checkpoint.check_best_metric(args, metric_names(args, [""], ["f"]))  # eval_pass@4 is logged
    assert metric_names(args, [""], ["f"]) == [
        "eval_reward",
        "eval_rewards/f/mean",
        "eval_pass@1",
        "eval_pass@4",
        "eval_avg@8",
    ]


def test_a_checkpoint_continues_on_another_world_size_only_with_its_rounds_kept():
    from types import SimpleNamespace

    from dsgrpo import checkpoint
    from dsgrpo.errors import CheckpointError

    model = SimpleNamespace(
        model_type="qwen2",
        vocab_size=1024,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        tie_word_embeddings=False,
    )
    two = checkpoint.run_identity(GRPOConfig(per_device_train_batch_size=4, num_generations=2), 2, model)
    assert (two["prompts_per_round"], two["steps_per_round"]) == (4, 1)
    # 1 rank × 8, or 1 rank × 4 with accumulation 2: the same round (4 prompts, one optimizer step)
    for kw in (
        {"per_device_train_batch_size": 8},
        {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2},
    ):
        checkpoint.check_can_continue(two, checkpoint.run_identity(GRPOConfig(num_generations=2, **kw), 1, model), "ck")
    one = checkpoint.run_identity(GRPOConfig(per_device_train_batch_size=4, num_generations=2), 1, model)
    with pytest.raises(
        CheckpointError,
        match=r"prompts_per_round: checkpoint 4, this run 2.*on 1 rank\(s\) set "
        r"per_device_train_batch_size × gradient_accumulation_steps = 8",
    ):
        checkpoint.check_can_continue(two, one, "ck")
    eight = checkpoint.run_identity(GRPOConfig(per_device_train_batch_size=8, num_generations=2), 1, model)
    with pytest.raises(
        CheckpointError,
        match=r"on 2 rank\(s\) set .* = 4 \(e.g. per_device_train_batch_size=4, "
        r"gradient_accumulation_steps=1;",
    ):
        checkpoint.check_can_continue(
            eight, checkpoint.run_identity(GRPOConfig(per_device_train_batch_size=8, num_generations=2), 2, model), "ck"
        )
    with pytest.raises(CheckpointError, match=r"8 completions per optimizer step, which 3 rank\(s\) cannot share"):
        checkpoint.check_can_continue(
            eight, checkpoint.run_identity(GRPOConfig(per_device_train_batch_size=8, num_generations=2), 3, model), "ck"
        )
    # a checkpoint of an older dsgrpo (no round in its identity) keeps its world size and geometry
    legacy = {k: v for k, v in two.items() if k not in ("prompts_per_round", "steps_per_round", "num_iterations")}
    with pytest.raises(CheckpointError, match=r"world_size: checkpoint 2, this run 1.*kept the world size"):
        checkpoint.check_can_continue(
            legacy,
            checkpoint.run_identity(GRPOConfig(per_device_train_batch_size=8, num_generations=2), 1, model),
            "ck",
        )
    checkpoint.check_can_continue(legacy, two, "ck")


def test_bf16_reaches_a_deepspeed_config_without_a_bf16_section():
    """bf16=True loads the engines in bf16; a user's DeepSpeed dict without a bf16 section must not leave DeepSpeed
    running them in fp32 (it did, silently). An explicit section wins; fp32 runs get none."""
    from dsgrpo.engines.builder import fill_auto_values

    plain = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": "auto"}
    on = GRPOConfig(output_dir="/tmp/unused", bf16=True)
    assert fill_auto_values(plain, on, hidden_size=None)["bf16"] == {"enabled": True}
    assert fill_auto_values({**plain, "bf16": {"enabled": False}}, on, hidden_size=None)["bf16"] == {"enabled": False}
    assert "bf16" not in fill_auto_values(plain, GRPOConfig(output_dir="/tmp/unused", bf16=False), hidden_size=None)


def test_auto_reduce_buckets_are_hidden_size_squared_but_never_tiny():
    """transformers fills reduce_bucket_size with hidden_size**2; a tiny model got dozens of gradient all-reduces a
    step from it (each waits for every rank). Below MIN_REDUCE_BUCKET elements the floor holds."""
    from dsgrpo.engines.builder import MIN_REDUCE_BUCKET, fill_auto_values

    args = GRPOConfig(output_dir="/tmp/unused")
    zero2 = load_deepspeed_config("zero2.json")
    bucket = lambda h: fill_auto_values(zero2, args, hidden_size=h)["zero_optimization"]["reduce_bucket_size"]  # noqa: E731
    assert MIN_REDUCE_BUCKET == 4194304
    assert bucket(128) == bucket(896) == MIN_REDUCE_BUCKET  # the demo's model, Qwen2.5-0.5B
    assert bucket(2048) == 2048 * 2048 and bucket(4096) == 4096 * 4096  # 1.5B and up: transformers' value
    zero3 = fill_auto_values(load_deepspeed_config("zero3.json"), args, hidden_size=128)["zero_optimization"]
    assert zero3["reduce_bucket_size"] == MIN_REDUCE_BUCKET and zero3["stage3_prefetch_bucket_size"] == int(
        0.9 * 128 * 128
    )
