"""dsgrpo's GRPOConfig against TRL 1.16's own (trl is a pinned test dependency): every field TRL's GRPOConfig has
(with transformers 5.19's TrainingArguments under it) exists in ours with the same default, and TRL-style configs
written the way R1-reproduction recipes write them load. The only escape is DELIBERATE, each with its reason."""

import dataclasses
import typing

import pytest
import yaml

from dsgrpo import GRPOConfig

trl = pytest.importorskip("trl")

# field → why dsgrpo's default differs from TRL's (the README's "Coming from TRL" table lists the same)
DELIBERATE = {
    "deepspeed": "dsgrpo always runs DeepSpeed; its default 'auto' is ZeRO-3 over several ranks and ZeRO-2 in a world "
    "of one (TRL: None, no DeepSpeed; None means 'auto' here)",
    "use_vllm": "dsgrpo is built around a colocated vLLM engine (TRL: False, generation with transformers)",
    "gradient_checkpointing": "'auto': the memory planner turns recomputation off when activations fit (TRL: True, "
    "a third more compute whenever they fit); true/false are TRL's",
}


# defaults that TRL's and transformers' own __post_init__ resolve, as ours does: (declared → resolved)
RESOLVED_AT_CONSTRUCTION = {
    "output_dir": {None: "trainer_output"},  # transformers' default folder
    "pad_to_multiple_of": {"auto": None},  # "auto" pads only on Trainium
}


def trl_fields():
    from trl import GRPOConfig as TRLConfig

    return {f.name: f for f in dataclasses.fields(TRLConfig)}


def default_of(f):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def test_trl_version_is_the_pinned_one():
    assert trl.__version__ == "1.16.0"


def test_every_trl_field_exists_with_trls_default():
    ours = {f.name: f for f in dataclasses.fields(GRPOConfig)}
    theirs = trl_fields()
    missing = sorted(n for n in theirs if n not in ours)
    assert not missing, f"TRL fields dsgrpo does not accept: {missing}"
    cfg = GRPOConfig()
    differ = {}
    for name, f in theirs.items():
        expected = default_of(f)
        value = getattr(cfg, name)
        # enums (transformers' IntervalStrategy, SchedulerType...) are str subclasses: compare their value
        expected = getattr(expected, "value", expected)
        if name in RESOLVED_AT_CONSTRUCTION:
            expected = RESOLVED_AT_CONSTRUCTION[name].get(expected, expected)
        if value != expected and name not in DELIBERATE:
            differ[name] = (expected, value)
    assert not differ, f"defaults that differ from TRL 1.16 (TRL, dsgrpo): {differ}"
    for name in DELIBERATE:  # a deliberate difference must still be a difference, or it is stale
        assert getattr(cfg, name) != default_of(theirs[name]), name


def test_trls_defaults_pass_our_validation_and_types():
    """Setting every field to TRL's default (as a TRL config written out in full would) is accepted."""
    theirs = trl_fields()
    hints = typing.get_type_hints(GRPOConfig)
    values = {}
    for name, f in theirs.items():
        value = default_of(f)
        value = getattr(value, "value", value)
        if name in DELIBERATE or value is dataclasses.MISSING or name not in hints:
            continue
        values[name] = value
    cfg = GRPOConfig(**values)
    assert cfg.num_generations == 8


# A recipe in the style of the public R1-reproduction projects (only TRL-valid keys: their own script keys such as
# model_name_or_path or dataset_name belong to their scripts, not to GRPOConfig). It uses every key the drop-in
# issue found refused.
RECIPE = """
bf16: false
use_vllm: true
vllm_gpu_memory_utilization: 0.7
do_eval: true
eval_strategy: steps
eval_steps: 100
gradient_accumulation_steps: 16
gradient_checkpointing: true
gradient_checkpointing_kwargs:
  use_reentrant: false
hub_model_id: Qwen2.5-1.5B-GRPO
hub_strategy: every_save
learning_rate: 2.0e-05
log_completions: true
log_level: info
logging_first_step: true
logging_steps: 1
logging_strategy: steps
lr_scheduler_type: cosine_with_min_lr
lr_scheduler_kwargs:
  min_lr_rate: 0.1
max_completion_length: 1024
max_steps: -1
num_generations: 8
num_train_epochs: 1
output_dir: data/Qwen2.5-1.5B-GRPO
per_device_eval_batch_size: 32
per_device_train_batch_size: 16
push_to_hub: false
report_to:
- none
save_strategy: steps
save_steps: 0.1
save_total_limit: 1
seed: 42
warmup_ratio: 0.1
sync_ref_model: false
use_liger_kernel: false
remove_unused_columns: false
ddp_find_unused_parameters: false
mask_truncated_completions: true
max_grad_norm: 0.2
reward_weights: [1.0, 0.25]
temperature: 1.0
epsilon: 0.2
epsilon_high: 0.28
loss_type: dapo
beta: 0.04
use_bias_correction_kl: true
"""


def test_a_recipe_with_every_previously_refused_key_loads(capsys):
    cfg = GRPOConfig.from_dict(yaml.safe_load(RECIPE))
    assert (cfg.save_steps, cfg.lr_scheduler_kwargs, cfg.gradient_checkpointing_kwargs) == (
        0.1,
        {"min_lr_rate": 0.1},
        {"use_reentrant": False},
    )
    # ddp_find_unused_parameters has no meaning under DeepSpeed: one warning line names it
    lines = [line for line in capsys.readouterr().err.splitlines() if "ddp_find_unused_parameters" in line]
    assert len(lines) == 1 and "DeepSpeed" in lines[0]


@pytest.mark.parametrize(
    "overrides",
    [
        # GRPOConfig(...) calls in TRL's own documentation that dsgrpo refused before
        dict(loss_type="sapo", sapo_temperature_neg=1.05, sapo_temperature_pos=1.0),
        dict(loss_type="luspo", importance_sampling_level="sequence"),
        dict(loss_type="vespo", vespo_k_pos=2.0, vllm_importance_sampling_mode="token_truncate"),
        dict(entropy_coef=0.01, use_adaptive_entropy=True, entropy_target=0.5),
        dict(off_policy_mask_threshold=0.5),
        dict(vllm_importance_sampling_clip_min=0.5, vllm_importance_sampling_mode="token_mask"),
        dict(cast_lm_head_to_fp32=True, ds3_gather_for_generation=False),
        dict(vllm_mode="server", vllm_server_base_url="http://localhost:8000", vllm_server_timeout=60),
        dict(steps_per_generation=16, gradient_accumulation_steps=16),
        dict(sync_ref_model=True, ref_model_mixup_alpha=0.9, ref_model_sync_steps=64),
        dict(top_entropy_quantile=0.2),
        dict(use_bias_correction_kl=False, beta=0.1),
    ],
)
def test_trl_documentation_configs_load(overrides):
    cfg = GRPOConfig(**overrides)
    for key, value in overrides.items():
        assert getattr(cfg, key) == value


def test_json_strings_for_dict_fields_as_trls_cli_passes_them():
    cfg = GRPOConfig.from_dict(
        {"model_init_kwargs": '{"attn_implementation": "sdpa"}', "generation_kwargs": '{"top_k": 10}'}
    )
    assert cfg.model_init_kwargs == {"attn_implementation": "sdpa"} and cfg.generation_kwargs == {"top_k": 10}
    with pytest.raises(ValueError, match="generation_kwargs.*JSON"):
        GRPOConfig(generation_kwargs="{top_k: 10")


def test_the_deprecated_cap_sets_clip_max_as_trl_does():
    cfg = GRPOConfig(vllm_importance_sampling_cap=5.0)
    assert cfg.vllm_importance_sampling_clip_max == 5.0 and cfg.vllm_importance_sampling_cap is None
