"""LoRA set-up and the merged-weight stream, in one process (no DeepSpeed engine: unpartitioned parameters
pass through the gathers as they are)."""

import pytest
import torch

peft = pytest.importorskip("peft")

from dsgrpo import GRPOTrainer  # noqa: E402
from dsgrpo.engines import lora  # noqa: E402
from dsgrpo.engines.weights import checkpoint_units, named_full_parameters  # noqa: E402
from dsgrpo.rollout.weight_sync import expected_checkpoint_shapes  # noqa: E402
from dsgrpo.testing import tiny_model  # noqa: E402


def base_model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model("qwen2"), dtype=torch.float32)


def trained_adapter(**config):
    """The tiny Qwen2 with a LoRA adapter whose B is random (as after training), so merging changes weights."""
    model = lora.wrap_with_lora(
        base_model(), peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", **config), 0
    )
    torch.manual_seed(1)
    for name, p in model.named_parameters():
        if ".lora_B." in name:
            p.data.normal_(0, 0.05)
    return model


def test_merged_stream_equals_peft_merge_and_unload():
    model = trained_adapter()
    streamed = dict(named_full_parameters(model, bucket_bytes=1 << 16))
    reference = {n: p.detach().clone() for n, p in model.merge_and_unload().named_parameters()}
    assert set(streamed) == set(reference)
    worst = max(float((streamed[n] - reference[n]).abs().max()) for n in reference)
    assert worst <= 1e-6
    q = "model.layers.0.self_attn.q_proj.weight"
    assert float((streamed[q] - base_model().state_dict()[q]).abs().max()) > 1e-3  # the adapter is in it


def test_merged_stream_uses_the_adapters_scaling_rslora():
    model = trained_adapter(use_rslora=True)
    streamed = dict(named_full_parameters(model, bucket_bytes=1 << 30))
    reference = {n: p.detach().clone() for n, p in model.merge_and_unload().named_parameters()}
    assert max(float((streamed[n] - reference[n]).abs().max()) for n in reference) <= 1e-6


def test_checkpoint_names_and_shapes_are_the_base_models():
    model = trained_adapter()
    plain = base_model()
    assert expected_checkpoint_shapes(model, tied_lm_head=False) == expected_checkpoint_shapes(
        plain, tied_lm_head=False
    )
    unit = next(u for u in checkpoint_units(model) if u.name == "model.layers.0.mlp.up_proj.weight")
    assert len(unit.params) == 3  # base weight + lora_A + lora_B, gathered together


def test_peft_model_with_peft_config_is_refused_before_anything_loads(tmp_path):
    model = trained_adapter()
    with pytest.raises(ValueError, match="already a PeftModel and peft_config"):
        GRPOTrainer(
            model, lambda completions, **kw: [0.0] * len(completions), peft_config=peft.LoraConfig(r=4), args=None
        )


@pytest.mark.parametrize(
    "config, message",
    [
        (lambda: peft.IA3Config(target_modules=["q_proj"]), "must be a peft.LoraConfig"),
        (lambda: peft.LoraConfig(r=4, use_dora=True), "use_dora"),
        (lambda: peft.LoraConfig(r=4, modules_to_save=["lm_head"]), "modules_to_save"),
        (lambda: {"r": 4, "lora_alpah": 8}, "peft_config: .*lora_alpah"),
        (lambda: "lora", "must be a peft.LoraConfig"),
    ],
)
def test_bad_peft_configs_name_the_field(config, message):
    with pytest.raises(ValueError, match=message):
        lora.as_lora_config(config())


def test_dict_peft_config_from_yaml():
    cfg = lora.as_lora_config({"r": 16, "lora_alpha": 32, "target_modules": "all-linear"})
    assert isinstance(cfg, peft.LoraConfig) and cfg.r == 16
    assert lora.fingerprint(cfg) == {"r": 16, "lora_alpha": 32, "use_rslora": False, "target_modules": "all-linear"}


def test_lora_on_an_embedding_is_refused():
    with pytest.raises(ValueError, match="non-linear layers .*embed_tokens"):
        lora.wrap_with_lora(base_model(), peft.LoraConfig(r=4, target_modules=["embed_tokens", "q_proj"]), 0)


def test_adapter_init_is_the_same_on_every_rank():
    a = lora.wrap_with_lora(base_model(), peft.LoraConfig(r=4, target_modules="all-linear"), seed=5)
    torch.manual_seed(123)  # a rank's global RNG state must not matter
    b = lora.wrap_with_lora(base_model(), peft.LoraConfig(r=4, target_modules="all-linear"), seed=5)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n
