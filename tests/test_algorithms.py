"""dsgrpo.algorithms against hand-derived numbers (derivations next to them), autograd of the written formula,
and property tests. Pure torch: no DeepSpeed, no vLLM."""

import math
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsgrpo.algorithms import (
    compute_advantages,
    dynamic_sampling_filter,
    entropy_from_logits,
    entropy_mask,
    kl_divergence,
    kl_penalized_token_rewards,
    policy_loss,
    sampler_correction,
    soft_overlong_penalty,
)

NAN = float("nan")


def close(a, b, atol=1e-5):
    return torch.allclose(torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32), atol=atol)


def test_algorithms_import_without_heavy_dependencies():
    code = (
        "import sys, dsgrpo.algorithms, dsgrpo; "
        "bad = [m for m in ('deepspeed', 'vllm', 'transformers') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# --------------------------------------------------------------------------------------- advantages
def test_group_advantages_by_hand():
    # group 1: r = (1, 0): mu = 0.5, sigma = sqrt((0.25 + 0.25) / 1) = 0.707107 → A = ±0.5 / 0.707207 = ±0.707000
    # group 2: r = (1, 1): sigma = 0 → A = 0 and the group counts in frac_reward_zero_std
    adv, stats = compute_advantages(torch.tensor([[1.0], [0.0], [1.0], [1.0]]), 2)
    assert close(adv, [0.707000, -0.707000, 0.0, 0.0])
    assert close(stats["std_per_group"], [0.707107, 0.0])
    assert close(stats["frac_reward_zero_std"], 0.5)


def test_weighted_nan_aware_advantages_by_hand():
    # weights (1, 0.5): r = nansum(w·r) = (1, NaN [all NaN stays NaN], 0 + 1 = 1, 3 + 0.5 = 3.5)
    # group 1 = (1, NaN): one valid value → sigma 0, A = (0, NaN→0)
    # group 2 = (1, 3.5): mu = 2.25, sigma = sqrt(2 · 1.25² / 1) = 1.767767 → A = ∓1.25 / 1.767867 = ∓0.707067
    rewards = torch.tensor([[1.0, NAN], [NAN, NAN], [0.0, 2.0], [3.0, 1.0]])
    adv, stats = compute_advantages(rewards, 2, reward_weights=[1.0, 0.5])
    assert close(adv, [0.0, 0.0, -0.707067, 0.707067])
    assert torch.isnan(stats["rewards"][1]) and close(stats["rewards"][[0, 2, 3]], [1.0, 1.0, 3.5])
    # "batch": sigma over the 3 valid r (1, 1, 3.5): mean 1.833333, var = (0.694444·2 + 2.777778) / 2 = 2.083333,
    # sigma = 1.443376 → group 2: ∓1.25 / 1.443476 = ∓0.865965
    adv, _ = compute_advantages(rewards, 2, reward_weights=[1.0, 0.5], scale_rewards="batch")
    assert close(adv, [0.0, 0.0, -0.865965, 0.865965])
    # "none" (and False): A = r - mu_group
    for scale in ("none", False):
        adv, _ = compute_advantages(rewards, 2, reward_weights=[1.0, 0.5], scale_rewards=scale)
        assert close(adv, [0.0, 0.0, -1.25, 1.25])


def test_normalize_then_sum_by_hand():
    # Each reward z-scored in its group: group 1: r1 (1, 0) → ±0.707000, r2 (0, 0) → 0;
    # group 2: r1 (2, 0): sigma 1.414214 → ±1 / 1.414314 = ±0.707057;
    #          r2 (4, 0): sigma 2.828427 → ±2/2.828527 = ±0.707082.
    # combined = (0.707000, -0.707000, 1.414139, -1.414139); batch mean 0,
    # std = sqrt((2·0.707000² + 2·1.414139²) / 3) = 1.290916 → A = combined / 1.291016
    rewards = torch.tensor([[1.0, 0.0], [0.0, 0.0], [2.0, 4.0], [0.0, 0.0]])
    adv, _ = compute_advantages(rewards, 2, multi_objective_aggregation="normalize_then_sum")
    assert close(adv, [0.547631, -0.547631, 1.095369, -1.095369], atol=2e-5)


def test_advantage_errors_name_the_problem():
    with pytest.raises(ValueError, match="groups of num_generations=4"):
        compute_advantages(torch.zeros(6, 1), 4)
    with pytest.raises(ValueError, match="one weight per reward function"):
        compute_advantages(torch.zeros(4, 2), 2, reward_weights=[1.0])
    with pytest.raises(ValueError, match="Unknown multi_objective_aggregation 'mean'.*sum_then_normalize"):
        compute_advantages(torch.zeros(4, 2), 2, multi_objective_aggregation="mean")


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(0, 5), min_size=8, max_size=8),
    st.lists(st.floats(-10, 10), min_size=2, max_size=2),
    st.lists(st.floats(0.5, 20), min_size=2, max_size=2),
)
def test_group_advantages_invariant_to_per_group_shift_and_scale(values, shifts, scales):
    r = torch.tensor(values, dtype=torch.float64).view(2, 4)
    moved = r * torch.tensor(scales, dtype=torch.float64).view(2, 1) + torch.tensor(shifts, dtype=torch.float64).view(
        2, 1
    )
    a, _ = compute_advantages(r.reshape(-1, 1), 4)
    b, _ = compute_advantages(moved.reshape(-1, 1), 4)
    # exact but for the 1e-4 guard: |Δ| ≤ |z| · 1e-4 · |1/σ - 1/(cσ)|, σ ≥ 0.5 for integer rewards → < 1e-3
    assert torch.allclose(a, b, atol=1e-3)


# --------------------------------------------------------------------------------------- policy loss
# Shared hand case. B = 2, T = 2, second token of row 1 masked.
LOGP = [[-1.0, -2.0], [-0.5, -1.5]]
OLD = [[-1.2, -1.7], [-0.5, -1.0]]
MASK = [[1.0, 1.0], [1.0, 0.0]]
ADV = [1.0, -2.0]
# log w = logp - old = (0.2, -0.3 | 0, -0.5) → w = (1.221403, 0.740818 | 1, 0.606531);
# clip(w, 0.8, 1.2) = (1.2, 0.8 | 1, 0.8)
# -min(wA, clip(w)A): row 0 (A = 1): -1.2, -0.740818; row 1 (A = -2): +2 (the masked token is +1.6)
# active sum = -1.2 - 0.740818 + 2 = 0.059182 over 3 tokens
HAND = {
    "dapo": 0.059182 / 3,
    "bnpo": 0.059182 / 3,
    "grpo": ((-1.2 - 0.740818) / 2 + 2.0) / 2,
    "dr_grpo": 0.059182 / (2 * 4),  # B · max_completion_length = 2 · 4
}


def _case(requires_grad=True):
    logp = torch.tensor(LOGP, requires_grad=requires_grad)
    return logp, torch.tensor(OLD), torch.tensor(ADV), torch.tensor(MASK)


@pytest.mark.parametrize("loss_type", sorted(HAND))
def test_loss_types_by_hand(loss_type):
    logp, old, adv, mask = _case()
    loss, m = policy_loss(logp, old, adv, mask, loss_type=loss_type, max_completion_length=4)
    assert close(loss, HAND[loss_type])
    # w > 1.2 with A > 0 only at (0, 0); nothing below 0.8 with A < 0 among active tokens
    assert close(m["clip_ratio/high_mean"], 1 / 3) and close(m["clip_ratio/low_mean"], 0.0)
    assert close(m["clip_ratio/region_mean"], 1 / 3)


def test_cispo_by_hand():
    # -min(w, 1.1)·A·logp: row 0: -1.1·1·(-1) = 1.1, -0.740818·1·(-2) = 1.481636; row 1: -1·(-2)·(-0.5) = -1
    # sum 1.581636 / 3 active tokens; the gradient flows only through logp (the weight is detached):
    # d/dlogp = -min(w, 1.1)·A / 3 → row 0: (-1.1/3, -0.740818/3); row 1: (2/3, 0)
    logp, old, adv, mask = _case()
    loss, _ = policy_loss(logp, old, adv, mask, loss_type="cispo", epsilon_high=1.1)
    assert close(loss, 1.581636 / 3)
    loss.backward()
    assert close(logp.grad, [[-1.1 / 3, -0.740818 / 3], [2 / 3, 0.0]])


def test_sequence_level_ratio_by_hand():
    # GSPO: s0 = (0.2 - 0.3) / 2 = -0.05 → w0 = 0.951229 (inside the clip range) → -0.951229 per token;
    # s1 = 0 / 1 → w1 = 1 → +2 on its one token. dapo: (-1.902459 + 2) / 3
    logp, old, adv, mask = _case()
    loss, _ = policy_loss(logp, old, adv, mask, importance_sampling_level="sequence")
    assert close(loss, (2 - 2 * 0.951229) / 3)


def test_delta_caps_the_ratio():
    # log w = 1 → w = e = 2.718282, A = -1: -min(w·A, 1.2·A) = 2.718282; with delta = 1.5: -min(-1.5, -1.2) = 1.5
    logp, old, adv, mask = torch.tensor([[0.0]]), torch.tensor([[-1.0]]), torch.tensor([-1.0]), torch.ones(1, 1)
    assert close(policy_loss(logp, old, adv, mask)[0], math.e)
    assert close(policy_loss(logp, old, adv, mask, delta=1.5)[0], 1.5)


@pytest.mark.parametrize("estimator, expected", [("k1", 0.5), ("k2", 0.125), ("k3", 0.106531)])
def test_kl_estimators_by_hand(estimator, expected):
    # logp = -1, ref = -1.5 → r = ref - logp = -0.5: k1 = 0.5, k2 = 0.125, k3 = e^-0.5 + 0.5 - 1 = 0.106531
    assert close(kl_divergence(torch.tensor([[-1.0]]), torch.tensor([[-1.5]]), estimator), [[expected]])


def test_kl_term_added_to_the_loss():
    # old = current (w = 1), A = 0 → the loss is β · masked mean of k3; with β = 0.1 and k3 = 0.106531
    logp = torch.tensor([[-1.0, -1.0]])
    loss, m = policy_loss(
        logp,
        None,
        torch.zeros(1),
        torch.tensor([[1.0, 0.0]]),
        beta=0.1,
        ref_per_token_logps=torch.tensor([[-1.5, 7.0]]),
    )
    assert close(loss, 0.0106531) and close(m["kl"], 0.106531)
    with pytest.raises(ValueError, match="ref_per_token_logps"):
        policy_loss(logp, None, torch.zeros(1), torch.ones(1, 2), beta=0.1)


@pytest.mark.parametrize(
    "mode, lo, hi, expected",
    [
        # old - sampler = (0.5, -1.0) → ρ = (1.648721, 0.367879); sequence: sum = -0.5 → ρ = 0.606531
        ("token_truncate", None, 1.5, [[1.5, 0.367879]]),
        ("token_mask", None, 1.5, [[0.0, 0.367879]]),
        ("token_mask", 0.5, 3.0, [[1.648721, 0.0]]),
        ("sequence_truncate", None, 0.5, [[0.5]]),
        ("sequence_truncate", 0.7, 3.0, [[0.7]]),
        ("sequence_mask", None, 0.5, [[0.0]]),
        ("sequence_mask", 0.5, 3.0, [[0.606531]]),
    ],
)
def test_sampler_correction_by_hand(mode, lo, hi, expected):
    rho = sampler_correction(torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]]), torch.ones(1, 2), mode, lo, hi)
    assert close(rho, expected)


def test_sampler_correction_multiplies_the_per_token_term():
    # old = current: term = -A per token; token_truncate ρ = (1.5, 0.367879) → loss = -A · (1.5 + 0.367879) / 2
    logp = torch.tensor([[-1.0, -2.0]])
    loss, m = policy_loss(
        logp,
        None,
        torch.tensor([1.0]),
        torch.ones(1, 2),
        sampler_per_token_logps=torch.tensor([[-1.5, -1.0]]),
        vllm_is_mode="token_truncate",
        vllm_is_clip_max=1.5,
    )
    assert close(loss, -(1.5 + 0.367879) / 2)
    assert close(m["sampling/importance_sampling_ratio/max"], 1.5) and close(
        m["sampling/importance_sampling_ratio/min"], 0.367879
    )


def test_unknown_variants_list_the_known_ones():
    logp, old, adv, mask = _case()
    with pytest.raises(ValueError, match="Unknown loss_type 'ppo'.*dapo"):
        policy_loss(logp, old, adv, mask, loss_type="ppo")
    with pytest.raises(ValueError, match="Unknown kl_estimator 'k4'.*k3"):
        policy_loss(logp, old, adv, mask, beta=0.1, ref_per_token_logps=old, kl_estimator="k4")
    with pytest.raises(ValueError, match="Unknown vllm_importance_sampling_mode.*sequence_mask"):
        policy_loss(logp, old, adv, mask, sampler_per_token_logps=old, vllm_is_mode="seq")


def test_sapo_by_hand():
    # SAPO: -σ(τ(w-1))·4/τ·A, τ = 1.0 where A > 0 (row 0), 1.05 elsewhere (row 1); grpo-style aggregation.
    # row 0: σ(0.221403) = 0.555126 → -2.220503; σ(-0.259182) = 0.435565 → -1.742259; mean -1.981381
    # row 1: w = 1 → σ(0) = 0.5 → -0.5·4/1.05·(-2) = +3.809524; its masked token does not count
    # loss = (-1.981381 + 3.809524) / 2 = 0.914071. SAPO logs no clip ratios (no hard clip).
    logp, old, adv, mask = _case()
    loss, m = policy_loss(logp, old, adv, mask, loss_type="sapo")
    assert close(loss, 0.914071)
    assert not any(k.startswith("clip_ratio") for k in m)
    # the gate's slope at w = 1 is 1: on-policy SAPO has GRPO's gradient, -A / (row tokens · rows)
    x = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    policy_loss(x, None, torch.tensor([0.5]), torch.ones(1, 2), loss_type="sapo")[0].backward()
    assert close(x.grad, [[-0.25, -0.25]])


def test_luspo_by_hand():
    # the clipped terms of HAND, summed per sequence (row 0: -1.2 - 0.740818 = -1.940818; row 1: +2), then the
    # mean over sequences: (-1.940818 + 2) / 2 = 0.029591
    logp, old, adv, mask = _case()
    loss, m = policy_loss(logp, old, adv, mask, loss_type="luspo", importance_sampling_level="token")
    assert close(loss, 0.029591) and "clip_ratio/high_mean" in m


def test_vespo_by_hand():
    # sequence log w = Σ masked log-ratios: row 0: 0.2 - 0.3 = -0.1 (w = 0.904837), row 1: 0 (w = 1)
    # row 0 (A ≥ 0: k = 2, λ = 3): log φ = 3 + 2·(-0.1) - 3·0.904837 = 0.085488 → φ = 1.089248
    # row 1 (A < 0: k = 3, λ = 2): log φ = 2 + 0 - 2 = 0 → φ = 1
    # -φ·A·logp: row 0: 1.089248·1, 1.089248·2; row 1: -1·(-2)·(-0.5) = -1 → (3.267744 - 1) / 3 = 0.755915 (dapo)
    logp, old, adv, mask = _case()
    loss, m = policy_loss(logp, old, adv, mask, loss_type="vespo")
    assert close(loss, 0.755915) and close(m["vespo/phi_seq_mean"], (1.089248 + 1) / 2)
    loss.backward()  # φ is detached: the gradient is -φ·A / 3 per active token
    assert close(logp.grad, [[-1.089248 / 3, -1.089248 / 3], [2 / 3, 0.0]])
    # the sampler correction enters φ (a token ρ of e^0.5 on row 1 makes its log w 0.5), not the product
    sampler = torch.tensor([[-1.2, -1.7], [-1.0, -1.0]])  # old - sampler = (0, 0 | 0.5, masked)
    loss2, _ = policy_loss(
        torch.tensor(LOGP),
        old,
        adv,
        mask,
        loss_type="vespo",
        sampler_per_token_logps=sampler,
        vllm_is_mode="token_truncate",
        vllm_is_clip_max=10.0,
    )
    phi1 = math.exp(2 + 3 * 0.5 - 2 * math.exp(0.5))  # k = 3, λ = 2, log w = 0.5
    assert close(loss2, (3 * 1.089248 - phi1 * 1.0) / 3)


def test_off_policy_mask_by_hand():
    # behaviour = sampler: row 0 equals π_θ (KL 0, and A > 0 anyway: kept); row 1: log π_b - log π_θ = 0 - (-0.5) =
    # 0.5 on its one active token (the masked 9.0 is ignored) > 0.1 with A < 0: dropped.
    # dapo: (-1.2 - 0.740818) / 3 = -0.646939 (the normaliser still counts the dropped row's token)
    logp, old, adv, mask = _case()
    sampler = torch.tensor([[-1.0, -2.0], [0.0, 9.0]])
    loss, _ = policy_loss(logp, old, adv, mask, sampler_per_token_logps=sampler, off_policy_mask_threshold=0.1)
    assert close(loss, -0.646939)
    assert close(
        policy_loss(logp, old, adv, mask, sampler_per_token_logps=sampler, off_policy_mask_threshold=0.6)[0],
        HAND["dapo"],
    )  # 0.5 ≤ 0.6: kept


def test_bias_corrected_kl_by_hand():
    # ref = (-1.5, -2 | -0.5, 156): r = ref - logp = (-0.5, 0 | 0, masked) → k3 = (0.106531, 0 | 0); the masked
    # token's 156 would overflow exp in k3 (inf · 0 = NaN) and must not reach it.
    # corrected: k3 · w = 0.106531 · 1.221403 = 0.130117 → dapo (0.059182 + 0.1 · 0.130117) / 3 = 0.024065
    # plain: (0.059182 + 0.1 · 0.106531) / 3 = 0.023278
    logp, old, adv, mask = _case()
    ref = torch.tensor([[-1.5, -2.0], [-0.5, 156.0]])
    loss, m = policy_loss(logp, old, adv, mask, beta=0.1, ref_per_token_logps=ref, kl_bias_correction=True)
    assert close(loss, 0.024065) and close(m["kl"], 0.130117 / 3)
    plain, _ = policy_loss(torch.tensor(LOGP), old, adv, mask, beta=0.1, ref_per_token_logps=ref)
    assert close(plain, 0.023278)
    loss.backward()
    assert torch.isfinite(logp.grad).all() and logp.grad[1, 1] == 0
    # on-policy (w ≡ 1) the value is the same but the gradient is not: ∂(k3·w)/∂logp = (1 - e^r) + k3 = -r
    # at r = -0.5: 0.5·β, against (1 - e^-0.5)·β = 0.393469·β without the correction
    for corrected, expected in ((True, 0.5), (False, 0.393469)):
        x = torch.tensor([[-1.0]], requires_grad=True)
        policy_loss(
            x,
            None,
            torch.zeros(1),
            torch.ones(1, 1),
            beta=0.1,
            ref_per_token_logps=torch.tensor([[-1.5]]),
            kl_bias_correction=corrected,
        )[0].backward()
        assert close(x.grad, [[0.1 * expected]])


def test_sampler_correction_bounds_may_be_open():
    # old - sampler = (0.5, -1.0) → ρ = (1.648721, 0.367879)
    old, sampler, mask = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]]), torch.ones(1, 2)
    assert close(sampler_correction(old, sampler, mask, "token_mask", 0.5, None), [[1.648721, 0.0]])
    assert close(sampler_correction(old, sampler, mask, "token_truncate", 0.5, None), [[1.648721, 0.5]])


def test_entropy_bonus_and_the_high_entropy_keep_mask():
    # keep_mask drops row 0's second token from the policy term only: dapo (-1.2 + 2) / 3 = 0.266667 (the
    # normaliser still counts the 3 active tokens, as TRL does). The bonus is the mean entropy over the kept active
    # tokens, (0.5 + 2.0) / 2 = 1.25, not rescaled by the loss type: loss = 0.266667 - 0.1 · 1.25 = 0.141667
    logp, old, adv, mask = _case()
    ent = torch.tensor([[0.5, 1.0], [2.0, 7.0]], requires_grad=True)
    keep = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    loss, m = policy_loss(logp, old, adv, mask, keep_mask=keep, entropies=ent, entropy_coef=0.1)
    assert close(loss, 0.141667) and close(m["policy_loss"], 0.266667)
    loss.backward()
    assert close(ent.grad, [[-0.05, 0.0], [-0.05, 0.0]])
    with pytest.raises(ValueError, match="entropies"):
        policy_loss(logp, old, adv, mask, entropy_coef=0.1)


def test_padding_never_overflows_into_nan():
    # a padded position may hold any log-prob (the reference's reached 156 nats in a real run): exp() of it is inf
    # in fp32, and inf · a zero mask is NaN. Every variant must stay finite.
    logp = torch.tensor([[-1.0, 0.0]], requires_grad=True)
    old = torch.tensor([[-1.1, -200.0]])
    sampler = torch.tensor([[-1.0, 200.0]])
    ref = torch.tensor([[-1.3, 156.0]])
    mask = torch.tensor([[1.0, 0.0]])
    for loss_type in ("grpo", "dapo", "cispo", "sapo", "luspo", "vespo", "dr_grpo", "bnpo"):
        for level in ("token", "sequence"):
            x = logp.detach().clone().requires_grad_()
            loss, _ = policy_loss(
                x,
                old,
                torch.tensor([1.0]),
                mask,
                loss_type=loss_type,
                importance_sampling_level=level,
                beta=0.1,
                ref_per_token_logps=ref,
                kl_bias_correction=True,
                max_completion_length=2,
                sampler_per_token_logps=sampler,
                vllm_is_mode="token_truncate",
                off_policy_mask_threshold=0.5,
            )
            loss.backward()
            assert torch.isfinite(loss) and torch.isfinite(x.grad).all() and x.grad[0, 1] == 0, (loss_type, level)


# ----------------------------------------------------------------------------------------- gradients
def _written_formula(logp, old, adv, mask, eps_lo, eps_hi, beta, ref, n_items):
    """The objective written out independently of the implementation (dapo, token level, k3)."""
    w = torch.exp(logp - old)
    a = adv[:, None]
    term = -torch.minimum(w * a, torch.clamp(w, 1 - eps_lo, 1 + eps_hi) * a)
    term = term + beta * (torch.exp(ref - logp) - (ref - logp) - 1)
    return (term * mask).sum() / n_items


def test_gradient_matches_autograd_of_the_written_formula():
    torch.manual_seed(0)
    logp = (torch.randn(4, 6, dtype=torch.float64) * 0.3 - 1).requires_grad_()
    old = logp.detach() + torch.randn(4, 6, dtype=torch.float64) * 0.2
    ref = logp.detach() + torch.randn(4, 6, dtype=torch.float64) * 0.2
    adv = torch.randn(4, dtype=torch.float64)
    mask = (torch.rand(4, 6) > 0.3).double()
    loss, _ = policy_loss(
        logp,
        old,
        adv,
        mask,
        epsilon_low=0.2,
        epsilon_high=0.28,
        beta=0.05,
        ref_per_token_logps=ref,
        num_items_in_batch=mask.sum() * 2,
        num_processes=2,
    )
    (g,) = torch.autograd.grad(loss, logp)
    expected = _written_formula(logp, old, adv, mask, 0.2, 0.28, 0.05, ref, mask.sum())
    (g2,) = torch.autograd.grad(expected, logp)
    assert torch.allclose(loss, expected, atol=1e-12) and torch.allclose(g, g2, atol=1e-12)


@pytest.mark.parametrize("loss_type, normaliser", [("dapo", 5.0), ("bnpo", 5.0), ("dr_grpo", 2 * 8.0)])
def test_on_policy_gradient_is_minus_advantage_over_normaliser(loss_type, normaliser):
    # old = current → w ≡ 1 (never clipped), ∂w/∂logp = 1, so ∂L/∂logp_bt = -A_b · m_bt / normaliser
    logp = torch.tensor([[-1.0, -2.0, -0.3], [-0.7, -0.1, -4.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv = torch.tensor([0.5, -1.5])
    loss, _ = policy_loss(logp, None, adv, mask, loss_type=loss_type, max_completion_length=8)
    loss.backward()
    assert close(logp.grad, -adv[:, None] * mask / normaliser)


# -------------------------------------------------------------------------------- split invariance
@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from([(1, 1), (1, 4), (2, 2), (4, 1), (2, 4)]))
def test_dapo_micro_batches_and_ranks_sum_to_the_full_batch_loss(seed, split):
    ranks, micro = split
    g = torch.Generator().manual_seed(seed)
    B, T = ranks * micro * 2, 5
    logp = torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3 - 1
    old = logp + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    mask = (torch.rand(B, T, generator=g) > 0.4).double()
    full, _ = policy_loss(logp, old, adv, mask)
    n_items = mask.sum()
    per_rank = []
    for r in range(ranks):  # rank r holds a contiguous shard, cut into `micro` micro-batches
        rows = torch.arange(B).view(ranks, micro, -1)[r]
        per_rank.append(
            sum(
                policy_loss(logp[i], old[i], adv[i], mask[i], num_items_in_batch=n_items, num_processes=ranks)[0]
                for i in rows
            )
        )
    assert torch.allclose(torch.stack(per_rank).mean(), full, atol=1e-10)


@settings(max_examples=30, deadline=None)
@given(
    st.integers(0, 10_000),
    st.sampled_from(["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]),
    st.sampled_from(["token", "sequence"]),
    st.sampled_from([None, "token_mask", "sequence_truncate"]),
)
def test_a_masked_token_never_changes_the_loss(seed, loss_type, level, is_mode):
    g = torch.Generator().manual_seed(seed)
    logp = torch.randn(3, 4, generator=g, dtype=torch.float64) * 0.3 - 1
    old = logp + torch.randn(3, 4, generator=g, dtype=torch.float64) * 0.2
    sampler = old + torch.randn(3, 4, generator=g, dtype=torch.float64) * 0.1
    ref = logp + torch.randn(3, 4, generator=g, dtype=torch.float64) * 0.1
    adv = torch.randn(3, generator=g, dtype=torch.float64)
    mask = torch.ones(3, 4, dtype=torch.float64)
    mask[0, 3] = mask[2, 1] = 0.0
    kw = dict(
        loss_type=loss_type,
        importance_sampling_level=level,
        beta=0.1,
        ref_per_token_logps=ref,
        sampler_per_token_logps=sampler,
        vllm_is_mode=is_mode,
        epsilon_high=0.28,
        max_completion_length=4,
    )
    x = logp.clone().requires_grad_()
    loss, _ = policy_loss(x, old, adv, mask, **kw)
    loss.backward()
    scrambled = logp.clone()
    scrambled[0, 3], scrambled[2, 1] = 5.0, -30.0
    noisy_old, noisy_ref, noisy_sampler = old.clone(), ref.clone(), sampler.clone()
    noisy_old[0, 3] = noisy_ref[2, 1] = noisy_sampler[0, 3] = 9.0
    loss2, _ = policy_loss(
        scrambled,
        noisy_old,
        adv,
        mask,
        **dict(kw, ref_per_token_logps=noisy_ref, sampler_per_token_logps=noisy_sampler),
    )
    assert torch.allclose(loss, loss2, atol=1e-12)
    assert x.grad[0, 3] == 0 and x.grad[2, 1] == 0


# ----------------------------------------------------------------------------- entropy and DAPO helpers
def test_entropy_by_hand_and_chunked():
    # uniform over 4 → log 4 = 1.386294; a one-hot-ish distribution → ~0
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0]]])
    assert close(entropy_from_logits(logits), [[1.386294, 0.0]])
    big = torch.randn(3, 7, 50)
    ref = torch.distributions.Categorical(logits=big).entropy()
    assert torch.allclose(entropy_from_logits(big, chunk_size=4), ref, atol=1e-5)


def test_entropy_mask_keeps_the_top_quantile():
    ent = torch.tensor([[0.1, 0.5, 0.9, 0.3], [0.7, 0.2, 9.0, 0.4]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 1]])  # the 9.0 is padding and must not set the threshold
    keep = entropy_mask(ent, mask, 0.5)  # active entropies 0.1 .. 0.9 (7 values): median 0.4
    assert keep.tolist() == [[False, True, True, False], [True, False, False, True]]
    assert entropy_mask(ent, mask, 1.0).tolist() == mask.bool().tolist()


def test_dynamic_sampling_filter_and_overlong_penalty():
    keep = dynamic_sampling_filter(torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5]), 2)
    assert keep.tolist() == [False, False, True, True, False, False]
    # L_max = 10, cache 4: 0 up to 6, then (6 - L) / 4, and -1 beyond 10
    pen = soft_overlong_penalty(torch.tensor([3, 6, 8, 10, 12]), 10, 4)
    assert close(pen, [0.0, 0.0, -0.5, -1.0, -1.0])


def test_kl_in_reward():
    # k1 = logp - ref per active token, times -β = -0.1; the last active token also gets the sequence reward
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]])
    ref = torch.tensor([[-1.5, -2.0, -1.0], [-1.0, -2.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    out = kl_penalized_token_rewards(torch.tensor([1.0, 2.0]), logp, ref, mask, beta=0.1)
    assert close(out, [[-0.05, 1.0, 0.0], [0.0, -0.1, 2.0]])
