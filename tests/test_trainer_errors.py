"""Bad input gets a clear error naming the problem and the fix, before any model is loaded; a run that goes
non-finite stops with the step and the metrics named. Single process (a world of one)."""

import json

import pytest
import torch
from datasets import Dataset

from dsgrpo import GRPOConfig, GRPOTrainer
from dsgrpo.testing import tiny_model


def reward(prompts, completions, **kw):
    return [float(len(c)) for c in completions]


def args(tmp_path, **kw):
    base = dict(
        output_dir=str(tmp_path / "out"),
        max_steps=1,
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=4,
        use_vllm=False,
        gradient_checkpointing=False,
    )
    return GRPOConfig(**{**base, **kw})


PROMPTS = Dataset.from_list([{"prompt": "count: 1 2 3"}, {"prompt": "write a number"}])


@pytest.mark.parametrize(
    "dataset, words",
    [
        (Dataset.from_list([{"question": "hi"}]), ["no 'prompt' column", "question", "Rename"]),
        (Dataset.from_list([{"prompt": "x"}]).select([]), ["empty"]),
    ],
)
def test_dataset_errors(tmp_path, dataset, words):
    with pytest.raises(ValueError) as info:
        GRPOTrainer(tiny_model("qwen2"), reward, args=args(tmp_path), train_dataset=dataset)
    for w in words:
        assert w in str(info.value)


def test_conversational_prompts_need_a_chat_template(tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model("qwen2"))
    tok.chat_template = None
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(ValueError, match="no chat template"):
        GRPOTrainer(tiny_model("qwen2"), reward, args=args(tmp_path), train_dataset=data, processing_class=tok)


def test_prompt_longer_than_the_limits(tmp_path):
    long = Dataset.from_list([{"prompt": "word " * 50}])
    with pytest.raises(ValueError, match=r"train_dataset\[0\] has \d+ prompt tokens, more than max_prompt_length=8"):
        GRPOTrainer(tiny_model("qwen2"), reward, args=args(tmp_path, max_prompt_length=8), train_dataset=long)
    with pytest.raises(ValueError, match="exceeds the generation context of 40 tokens"):
        GRPOTrainer(tiny_model("qwen2"), reward, args=args(tmp_path, vllm_max_model_length=40), train_dataset=long)


def test_model_and_deepspeed_config_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such directory"):
        GRPOTrainer(str(tmp_path / "missing_model"), reward, args=args(tmp_path), train_dataset=PROMPTS)
    with pytest.raises(FileNotFoundError, match="deepspeed='nope.json'"):
        GRPOTrainer(tiny_model("qwen2"), reward, args=args(tmp_path, deepspeed="nope.json"), train_dataset=PROMPTS)
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        GRPOTrainer(tiny_model("qwen2"), reward, args=args(tmp_path, deepspeed=str(bad)), train_dataset=PROMPTS)


def test_unsupported_arguments_and_reward_kinds_are_refused(tmp_path):
    with pytest.raises(ValueError, match="peft_config: .*'rank'"):
        GRPOTrainer(tiny_model("qwen2"), reward, args=args(tmp_path), train_dataset=PROMPTS, peft_config={"rank": 8})
    with pytest.raises(TypeError, match=r"reward_funcs\[1\] = 3 is not a reward source"):
        GRPOTrainer(tiny_model("qwen2"), [reward, 3], args=args(tmp_path), train_dataset=PROMPTS)


def calculator(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def test_tools_and_rollout_func_misuse_is_refused_before_loading(tmp_path):
    with pytest.raises(ValueError, match="tools need conversational prompts"):
        GRPOTrainer(tiny_model("qwen2"), reward, args=args(tmp_path), train_dataset=PROMPTS, tools=[calculator])
    with pytest.raises(ValueError, match="calculator_without_docs"):

        def calculator_without_docs(a, b):
            return a + b

        GRPOTrainer(
            tiny_model("qwen2"), reward, args=args(tmp_path), train_dataset=PROMPTS, tools=[calculator_without_docs]
        )
    with pytest.raises(ValueError, match="rollout_func replaces the trainer's generation"):
        GRPOTrainer(
            tiny_model("qwen2"),
            reward,
            args=args(tmp_path),
            train_dataset=PROMPTS,
            tools=[calculator],
            rollout_func=lambda prompts, trainer: {},
        )
    with pytest.raises(TypeError, match="rollout_func must be a function"):
        GRPOTrainer(tiny_model("qwen2"), reward, args=args(tmp_path), train_dataset=PROMPTS, rollout_func="mine")
    # partial rollouts: a rollout_func's completions cannot be cut token by token; agent_rollout's pause between
    # calls on GRPOTrainer (rollout/agent_partial.py), while AsyncGRPOTrainer runs them beside training already
    from dsgrpo import AsyncGRPOTrainer, agent_reward, agent_rollout

    with pytest.raises(ValueError, match="partial_rollout=True continues completions token by token"):
        GRPOTrainer(
            tiny_model("qwen2"),
            reward,
            args=args(tmp_path, partial_rollout=True, use_vllm=True),
            train_dataset=PROMPTS,
            rollout_func=lambda prompts, trainer: {},
        )
    with pytest.raises(ValueError, match="agent_rollout on AsyncGRPOTrainer"):
        AsyncGRPOTrainer(
            tiny_model("qwen2"),
            agent_reward,
            args=args(tmp_path, partial_rollout=True, use_vllm=True),
            train_dataset=PROMPTS,
            rollout_func=agent_rollout(lambda client, row: 1.0),
        )


def test_missing_pad_token_falls_back_to_eos_with_a_warning(tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model("qwen2"))
    tok.pad_token = None
    with pytest.warns(UserWarning, match="no pad token; using eos"), pytest.raises(ValueError, match="prompt"):
        GRPOTrainer(
            tiny_model("qwen2"),
            reward,
            args=args(tmp_path),
            processing_class=tok,
            train_dataset=Dataset.from_list([{"text": "x"}]),
        )
    assert tok.pad_token == tok.eos_token


@pytest.mark.slow
def test_non_finite_training_stops_with_the_step_named(tmp_path):
    import torch

    cfg = args(tmp_path, max_steps=4, logging_steps=1)
    trainer = GRPOTrainer(tiny_model("qwen2"), reward, args=cfg, train_dataset=PROMPTS)

    # from the second optimizer step on, the training forward (the only one with autograd on) yields NaN logits:
    # the output head's, which engines/forward.py applies chunk by chunk
    def poison(module, inputs, output):
        if torch.is_grad_enabled() and trainer.state.global_step >= 1:
            return output * float("nan")
        return output

    trainer.policy.module.get_output_embeddings().register_forward_hook(poison)
    with pytest.raises(
        RuntimeError,
        match=r"Non-finite training values at optimizer step 2: \{'grad_norm': "
        r"(nan|inf).*Last checkpoint: none saved yet",
    ):
        trainer.train()
    assert trainer.state.global_step == 1  # the failed step is not counted
    assert [json.loads(l)["step"] for l in open(tmp_path / "out" / "metrics.jsonl")] == [1]  # written so far: kept


def test_unsupported_reward_sources_are_refused_before_loading(tmp_path):
    with pytest.raises(ValueError, match="is a Qwen2ForCausalLM, not a sequence-classification model"):
        GRPOTrainer(tiny_model("qwen2"), [reward, tiny_model("qwen2")], args=args(tmp_path), train_dataset=PROMPTS)
    with pytest.raises(ValueError, match="neither a built-in reward"):
        GRPOTrainer(tiny_model("qwen2"), "accuracy_rewrd", args=args(tmp_path), train_dataset=PROMPTS)


def test_model_instance_without_a_tokenizer_is_refused(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_model("qwen2")))
    model.name_or_path = str(tmp_path)  # built in memory: nothing to load a tokenizer from
    with pytest.raises(ValueError, match="(?s)has no tokenizer .*Pass processing_class"):
        GRPOTrainer(model, reward, args=args(tmp_path), train_dataset=PROMPTS)
    assert not (tmp_path / "out" / "initial_model").exists()


def test_quantization_config_without_an_adapter_is_refused_before_any_load(tmp_path, capsys):
    """TRL 1.16's quantization_config (QLoRA's 4-bit base), in TRL's argument position: without peft_config a
    clear error naming why and the fix, raised before a model is read (the path does not even exist); set twice is
    an error; a config that is not bitsandbytes' is refused; with a model passed already loaded it is ignored with a
    warning, as TRL ignores it. (QLoRA itself trains in tests/test_qlora_dist.py.)"""
    import inspect

    from transformers import AutoModelForCausalLM, BitsAndBytesConfig
    from trl import GRPOTrainer as TRLTrainer

    assert list(inspect.signature(GRPOTrainer.__init__).parameters) == list(
        inspect.signature(TRLTrainer.__init__).parameters
    )  # positional order as TRL's
    four_bit = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")
    missing = str(tmp_path / "not_loaded")
    with pytest.raises(
        ValueError,
        match=r"quantization_config \(4-bit, bitsandbytes\) without peft_config: a quantised base cannot be "
        r"trained.*Pass peft_config",
    ):
        GRPOTrainer(missing, reward, args=args(tmp_path), train_dataset=PROMPTS, quantization_config=four_bit)
    with pytest.raises(ValueError, match=r"\(8-bit, bitsandbytes\) without peft_config"):
        GRPOTrainer(
            missing,
            reward,
            train_dataset=PROMPTS,
            args=args(tmp_path, model_init_kwargs={"quantization_config": {"load_in_8bit": True}}),
        )
    with pytest.raises(ValueError, match="set both as a GRPOTrainer argument and in args.model_init_kwargs"):
        GRPOTrainer(
            missing,
            reward,
            train_dataset=PROMPTS,
            quantization_config=four_bit,
            args=args(tmp_path, model_init_kwargs={"quantization_config": {"load_in_4bit": True}}),
        )
    from dsgrpo import quantization

    with pytest.raises(ValueError, match="bitsandbytes only; set load_in_4bit=True"):
        quantization.check("some/model", {"quant_method": "gptq", "bits": 4}, None, peft_config={"r": 8})
    loaded = AutoModelForCausalLM.from_pretrained(tiny_model("qwen2"))
    assert "ignored" in quantization.check(loaded, four_bit, None)
    loaded.is_loaded_in_4bit = True  # what transformers sets on a bitsandbytes-loaded model
    with pytest.raises(ValueError, match="a model loaded in 4 bits without peft_config"):
        quantization.check(loaded, None, None)
    assert quantization.check(loaded, None, None, peft_config={"r": 8}) is None
    # a YAML run's dict: dtypes by name; an unset compute dtype is the run's training dtype
    made = quantization.bnb_config(None, {"quantization_config": {"load_in_4bit": True}}, torch.bfloat16)
    assert made.load_in_4bit and made.bnb_4bit_compute_dtype == torch.bfloat16
    made = quantization.bnb_config({"load_in_4bit": True, "bnb_4bit_compute_dtype": "float32"}, None, torch.bfloat16)
    assert made.bnb_4bit_compute_dtype == torch.float32
    stored = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_storage=torch.float32)
    with pytest.raises(ValueError, match="bnb_4bit_quant_storage=float32 but the engines hold the model in bfloat16"):
        quantization.bnb_config(stored, None, torch.bfloat16)
    assert quantization.bnb_config(stored, None, torch.float32) is stored
    with pytest.raises(ValueError, match="quantization_config: .*Give BitsAndBytesConfig's fields"):
        quantization.bnb_config({"load_in_4bit": True, "load_in_8bit": True}, None, torch.float32)
