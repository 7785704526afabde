"""Chunked log-probs (engines/forward.py) against the full-logits path they replace, on real tiny models in fp32:
values and gradients equal to 1e-6, with and without truncation, entropy and MoE routers, one chunk or many; and
the peak of the chunked path stays O(chunk × V)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from dsgrpo.algorithms import Truncation, entropy_from_logits, truncate_logits
from dsgrpo.engines.forward import chunk_tokens_for, policy_forward
from dsgrpo.testing import tiny_model


def full_logits_forward(model, input_ids, attention_mask, T, temperature, truncation):
    """dsgrpo's path before chunking: the [B, T, V] fp32 logits, a log-softmax copy, gather."""
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        logits_to_keep=T + 1,
        use_cache=False,
    )
    logits = out.logits[:, :-1, :].float() / temperature
    targets = input_ids[:, -T:]
    sampled = logits if truncation is None else truncate_logits(logits, truncation, keep=targets)
    logps = torch.log_softmax(sampled, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    full = torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return logps, entropy_from_logits(sampled), full


def batch(seed=0, B=3, P=5, T=7, V=1024):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (B, P + T), generator=g)
    mask = torch.ones(B, P + T, dtype=torch.long)
    mask[0, :2] = 0  # a left-padded prompt
    mask[1, -3:] = 0  # right-padded completions
    mask[2, -1:] = 0
    return ids, mask, T


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    return {
        name: AutoModelForCausalLM.from_pretrained(tiny_model(name), dtype=torch.float32)
        for name in ("qwen2", "qwen2-tied", "qwen3-moe", "gemma2")
    }


@pytest.mark.parametrize("name", ["qwen2", "qwen2-tied", "qwen3-moe", "gemma2"])  # gemma2: soft-capped logits
@pytest.mark.parametrize("truncation", [None, Truncation(top_k=50, top_p=0.9)], ids=["plain", "top_k_top_p"])
@pytest.mark.parametrize("chunk", [0, 4], ids=["one_chunk", "chunks_of_4"])
def test_chunked_log_probs_and_gradients_equal_the_full_logits_path(models, name, truncation, chunk):
    model = models[name]
    ids, mask, T = batch()
    real = mask[:, -T:].bool()
    weights = torch.randn(ids.shape[0], T, generator=torch.Generator().manual_seed(1))

    def grads_of(loss):
        model.zero_grad(set_to_none=True)
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    ref_logps, ref_entropy, ref_full = full_logits_forward(model, ids, mask, T, 0.7, truncation)
    ref_grads = grads_of(((ref_logps + 0.3 * ref_entropy + 0.2 * ref_full) * weights * real).sum())

    f = policy_forward(
        model,
        ids,
        mask,
        T,
        0.7,
        with_entropy=True,
        entropy_grad=True,
        truncation=truncation,
        with_full=True,
        chunk_tokens=chunk,
    )
    for ours, ref in ((f.logps, ref_logps), (f.entropy, ref_entropy), (f.full_logps, ref_full)):
        assert torch.allclose(ours[real], ref[real], atol=1e-6, rtol=0), (ours - ref)[real].abs().max()
        assert (ours[~real] == 0).all()  # padding is not computed
    grads = grads_of(((f.logps + 0.3 * f.entropy + 0.2 * f.full_logps) * weights * real).sum())
    assert grads.keys() == ref_grads.keys() and len(grads) > 10
    for n in grads:  # relative to the gradient's scale: fp32 sums taken in another order differ in their last bits,
        # by an amount that depends on the CPU's kernels: < 1e-6 on the Intel Xeons this was written on, 1.13e-6 on
        # a gradient of 1.07 on an AMD EPYC (Zen 4); 4e-6 is ~34 ulps, while a wrong chunk is off by > 1e-3
        scale = ref_grads[n].abs().max().clamp(min=1.0)
        assert (grads[n] - ref_grads[n]).abs().max() <= 4e-6 * scale, (n, (grads[n] - ref_grads[n]).abs().max(), scale)


def test_entropy_without_its_graph_and_no_grad_forward(models):
    model = models["qwen2"]
    ids, mask, T = batch(seed=3)
    f = policy_forward(model, ids, mask, T, 1.0, with_entropy=True, entropy_grad=False, chunk_tokens=2)
    assert f.logps.requires_grad and not f.entropy.requires_grad and f.full_logps is None
    with torch.no_grad():
        g = policy_forward(model, ids, mask, T, 1.0, chunk_tokens=2)
    ref, _, _ = full_logits_forward(model, ids, mask, T, 1.0, None)
    real = mask[:, -T:].bool()
    assert torch.allclose(g.logps[real], ref.detach()[real], atol=1e-6, rtol=0)


def test_auto_chunk_keeps_a_chunk_of_logits_near_256_mib():
    assert chunk_tokens_for(151_936) == 441
    assert chunk_tokens_for(1024) == 65536
    assert chunk_tokens_for(151_936, chunk_tokens=128) == 128


def test_a_model_that_changes_its_logits_after_the_head_is_refused(models):
    model = AutoModelForCausalLM.from_pretrained(tiny_model("qwen2"), dtype=torch.float32)
    inner = model.forward

    def capped(*a, **k):  # a soft-capping model (Gemma 2) does this after its head
        out = inner(*a, **k)
        out.logits = torch.tanh(out.logits / 2.0) * 2.0
        return out

    model.forward = capped
    ids, mask, T = batch()
    with pytest.raises(NotImplementedError, match="after the output head"):
        policy_forward(model, ids, mask, T)


@pytest.mark.parametrize("name", ["qwen2", "llama-tied", "gemma2", "qwen3-moe", "opt"])
def test_packing_leak_measures_whether_attention_keeps_packed_sequences_apart(name):
    """Issue 27: packed steps are exact only where a packed sequence cannot see its neighbour. transformers 5's
    sdpa/eager masks keep them apart for these families (0 exactly for dense models; an MoE's token-grouped expert
    GEMMs round differently by ≈ 1e-7); OPT builds its own causal mask over the whole row and leaks O(0.1)."""
    from dsgrpo.engines.forward import packing_leak

    model = AutoModelForCausalLM.from_pretrained(tiny_model(name), dtype=torch.float32)
    model.train()
    leak = packing_leak(model, model.config.vocab_size)
    assert model.training  # the probe runs without dropout and gives the mode back
    if name == "opt":
        assert leak > 0.05
    else:
        assert leak <= 1e-6
