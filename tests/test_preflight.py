"""The preflight (dsgrpo/preflight.py) decides a run without building it: one process, no engine, no generator."""

import dataclasses
import os

import pytest
from datasets import Dataset

from dsgrpo import GRPOConfig
from dsgrpo.preflight import RunPlan, preflight
from dsgrpo.rollout.sources import GenerationSource
from dsgrpo.testing import tiny_model


def reward(prompts, completions, **kw):
    return [float(len(c)) for c in completions]


PROMPTS = Dataset.from_list([{"prompt": f"count to {i}"} for i in range(6)])


def config(tmp_path, **kw):
    base = dict(
        output_dir=str(tmp_path / "out"),
        max_steps=3,
        per_device_train_batch_size=4,
        num_generations=2,
        gradient_accumulation_steps=2,
        max_completion_length=8,
        use_vllm=False,
        gradient_checkpointing=False,
        beta=0.0,
    )
    return GRPOConfig(**{**base, **kw})


def test_a_plan_holds_every_derived_setting_and_nothing_is_built(tmp_path):
    import gc

    import torch

    def models():  # the model modules alive in this process (other tests may keep theirs)
        gc.collect()
        return {
            id(o) for o in gc.get_objects() if isinstance(o, torch.nn.Module) and type(o).__name__.startswith("Qwen2")
        }

    before = models()
    args = config(tmp_path)
    plan = preflight(tiny_model("qwen2"), [reward], args, PROMPTS, rollout_source=GenerationSource)
    assert isinstance(plan, RunPlan) and plan.args is args
    assert (plan.world, plan.spg) == (1, 2)  # TRL: steps_per_generation defaults to gradient_accumulation_steps
    assert plan.prompts_per_round == 4 * 1 * 2 // 2  # generation batch (per device × world × spg) over the group
    assert plan.step_plan.max_steps == 3 and plan.schedule is not None
    assert plan.ds_config["zero_optimization"]["stage"] in (0, 1, 2, 3)
    assert plan.ref_ds_config is None  # beta 0: no reference engine
    assert plan.rewards.names == ["reward"] and plan.tool_runner is None and plan.environment_set is None
    assert len(plan.train_prompts) == 6 and plan.eval_prompts == {}
    assert plan.model_path == tiny_model("qwen2") and plan.tokenizer.padding_side == "left"
    assert plan.sampling.max_tokens == 8 and plan.adapter is None and plan.resume_path is None
    assert os.path.isfile(os.path.join(args.output_dir, "resolved_config.yaml"))
    # nothing heavy was built: no module of the model's class was made
    assert models() <= before
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.spg = 4
    # the trainer keeps every field under its name; items() does not copy them
    assert dict(plan.items())["rewards"] is plan.rewards


def test_a_refused_run_writes_no_resolved_config(tmp_path):
    args = config(tmp_path, vllm_max_model_length=12)  # 8 completion tokens leave no room for these prompts
    with pytest.raises(ValueError, match="generation context of 12 tokens"):
        preflight(
            tiny_model("qwen2"),
            [reward],
            args,
            Dataset.from_list([{"prompt": "word " * 20}]),
            rollout_source=GenerationSource,
        )
    assert not os.path.exists(os.path.join(args.output_dir, "resolved_config.yaml"))


def test_a_model_instance_is_saved_once_for_the_generator_and_its_config_read(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model("qwen2"))
    tok = AutoTokenizer.from_pretrained(tiny_model("qwen2"))
    args = config(tmp_path)
    plan = preflight(model, [reward], args, PROMPTS, processing_class=tok, rollout_source=GenerationSource)
    assert plan.model_path == os.path.join(args.output_dir, "initial_model") and plan.model_config is model.config
    assert os.path.isfile(os.path.join(plan.model_path, "config.json")) and plan.tokenizer is tok
