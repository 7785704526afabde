"""The trainer's reproduction of the sampler's truncation (top_k / top_p / min_p) against the engines' own code:
vLLM's top-k/top-p op and min-p logits processor, and transformers' logits warpers. If an engine changes its rule,
these fail, not a run that silently stops learning."""

import math

import pytest
import torch

from dsgrpo.algorithms import Truncation, entropy_from_logits, truncate_logits


def vllm_reference(logits, top_k, top_p, min_p):
    """vLLM 0.32's sampler on tempered logits: the min_p processor (argmax-invariant), then top-k/top-p."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    z = logits.clone()
    if min_p:
        probs = z.softmax(-1)
        z = z.masked_fill(probs < probs.amax(-1, keepdim=True) * min_p, float("-inf"))
    k = torch.full((z.shape[0],), top_k, dtype=torch.long) if top_k else None
    p = torch.full((z.shape[0],), top_p) if top_p is not None and top_p < 1 else None
    return apply_top_k_top_p_pytorch(z, k, p)


def hf_reference(logits, top_k, top_p, min_p):
    from transformers.generation.logits_process import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    z = logits.clone()
    ids = torch.zeros(z.shape[0], 1, dtype=torch.long)
    for warper in (
        ([TopKLogitsWarper(top_k)] if top_k else [])
        + ([TopPLogitsWarper(top_p)] if top_p < 1 else [])
        + ([MinPLogitsWarper(min_p)] if min_p else [])
    ):
        z = warper(ids, z)
    return z


CASES = [(10, 1.0, None), (0, 0.9, None), (0, 1.0, 0.1), (10, 0.9, None), (5, 0.8, 0.05), (0, 0.5, 0.2), (1, 1.0, None)]


@pytest.mark.parametrize("top_k, top_p, min_p", CASES)
def test_the_same_tokens_survive_as_in_vllm(top_k, top_p, min_p):
    torch.manual_seed(0)
    logits = torch.randn(16, 300) * 3
    ours = truncate_logits(logits, Truncation(top_k, top_p, min_p, order="vllm"))
    ref = vllm_reference(logits, top_k, top_p, min_p)
    assert torch.equal(torch.isinf(ours), torch.isinf(ref))
    kept = ~torch.isinf(ours)
    assert torch.equal(ours[kept], logits[kept])  # survivors keep their logits


@pytest.mark.parametrize("top_k, top_p, min_p", CASES)
def test_the_same_tokens_survive_as_in_transformers_generate(top_k, top_p, min_p):
    torch.manual_seed(1)
    logits = torch.randn(16, 300) * 3
    ours = truncate_logits(logits, Truncation(top_k, top_p, min_p, order="hf"))
    assert torch.equal(torch.isinf(ours), torch.isinf(hf_reference(logits, top_k, top_p or 1.0, min_p)))


def test_by_hand_and_the_sampled_token_is_kept():
    # logits (3, 2, 1, 0): probabilities ∝ (e³, e², e, 1) = (0.644, 0.237, 0.087, 0.032)
    z = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    assert torch.isinf(truncate_logits(z, Truncation(top_k=2))).tolist() == [[False, False, True, True]]
    # top_p = 0.8: 0.644 < 0.8, 0.644 + 0.237 = 0.881 ≥ 0.8 → the two most likely
    assert torch.isinf(truncate_logits(z, Truncation(top_p=0.8))).tolist() == [[False, False, True, True]]
    # min_p = 0.1: keep p ≥ 0.0644 → three tokens
    assert torch.isinf(truncate_logits(z, Truncation(min_p=0.1))).tolist() == [[False, False, False, True]]
    # the sampled token (index 3) survives even outside the top-2 (a boundary tie or rounding on the engine's side)
    kept = truncate_logits(z, Truncation(top_k=2), keep=torch.tensor([3]))
    assert torch.isinf(kept).tolist() == [[False, False, True, False]] and kept[0, 3] == 0.0
    # nothing set: the logits themselves
    assert truncate_logits(z, Truncation()) is z


def test_log_probs_and_entropy_of_the_truncated_distribution():
    z = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    t = truncate_logits(z, Truncation(top_k=2))
    p = torch.softmax(torch.tensor([3.0, 2.0]), -1)
    assert torch.allclose(torch.log_softmax(t, -1)[0, :2], p.log())
    expected = -(p * p.log()).sum()
    assert torch.allclose(entropy_from_logits(t), expected.reshape(1)) and math.isfinite(entropy_from_logits(t).item())
