"""engines/routing.py on tiny local Qwen3-MoE and Qwen2-MoE models (transformers, fp32, one process): recorded routes
replayed change nothing; other routes replayed are the experts every layer uses, with the gate weights the router
gives them, while gradients still reach the router; -1 keeps the router's choice; agreement counts what matched."""

import pytest
import torch

from dsgrpo.engines.routing import RoutingTap, routes_of
from dsgrpo.testing import tiny_model

MOE = ["qwen3-moe", "qwen2-moe"]


def load(name):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_model(name), dtype=torch.float32)


def ids():
    return torch.tensor([[1, 5, 9, 12, 30, 31, 32, 33], [7, 8, 40, 41, 42, 43, 44, 45]])


def experts_used(model):
    """Each layer's expert indices and gate weights as the experts module receives them (a pre-hook)."""
    seen = []
    handles = []
    for module in model.modules():
        if type(module).__name__.endswith("MoeExperts"):
            handles.append(module.register_forward_pre_hook(
                lambda m, args: seen.append((args[1].clone(), args[2].detach().clone()))))
    return seen, handles


@pytest.mark.parametrize("name", MOE)
def test_replaying_recorded_routes_changes_nothing_and_agrees(name):
    model = load(name)
    tap = RoutingTap(model)
    assert tap.is_moe and len(tap.routers) == model.config.num_hidden_layers
    with torch.no_grad(), tap.record() as recorded:
        plain = model(ids()).logits
    routes = routes_of(recorded)
    assert routes.shape == (16, model.config.num_hidden_layers, model.config.num_experts_per_tok)
    with torch.no_grad(), tap.replay(routes):
        again = model(ids()).logits
    assert torch.equal(plain, again)
    assert tap.agreement == 1.0 and tap.compared == 16 * model.config.num_hidden_layers


@pytest.mark.parametrize("name", MOE)
def test_replayed_experts_are_used_with_the_routers_weights_and_the_router_still_learns(name):
    model = load(name)
    tap = RoutingTap(model)
    with torch.no_grad(), tap.record() as recorded:
        plain = model(ids()).logits
    own = routes_of(recorded)
    other = (own + 1) % model.config.num_experts  # a different expert set for every token and layer
    seen, handles = experts_used(model)
    logits_seen = []
    hooks = [r.register_forward_hook(lambda m, i, out: logits_seen.append(out[0].detach())) for r in tap.routers]
    with tap.replay(other):
        out = model(ids()).logits
    for h in handles + hooks:
        h.remove()
    # the first layer's own choice is the recorded one, never the shifted one; a later layer's own choice follows
    # the replayed earlier layers and may happen to meet what is given
    assert tap.agreement < 0.25 and tap.compared == 16 * model.config.num_hidden_layers
    assert len(seen) == model.config.num_hidden_layers
    for layer, (index, weight) in enumerate(seen):
        assert torch.equal(index, other[:, layer, :])  # the experts this layer computed with
        expected = torch.softmax(logits_seen[layer], dim=-1).gather(-1, other[:, layer, :])
        if model.config.norm_topk_prob:
            expected = expected / expected.sum(-1, keepdim=True)
            assert torch.allclose(weight.sum(-1), torch.ones(16))
        assert torch.allclose(weight, expected, atol=1e-6)
    assert not torch.allclose(out, plain, atol=1e-4)  # other experts, other outputs
    out.sum().backward()
    for router in tap.routers:  # the gate weights come from the router's logits: it keeps learning
        assert router.weight.grad is not None and router.weight.grad.abs().max() > 0


def test_minus_one_keeps_the_routers_own_choice_and_is_not_compared():
    model = load("qwen3-moe")
    tap = RoutingTap(model)
    with torch.no_grad(), tap.record() as recorded:
        plain = model(ids()).logits
    given = (routes_of(recorded) + 1) % 4
    given[:8] = -1  # the first sequence's routes unknown (prompt tokens a sampler did not report)
    seen, handles = experts_used(model)
    with torch.no_grad(), tap.replay(given):
        out = model(ids()).logits
    for h in handles:
        h.remove()
    assert torch.equal(seen[0][0][:8], routes_of(recorded)[:8, 0])
    assert torch.allclose(out[0, 0], plain[0, 0], atol=1e-5)  # the first token's output never sees a replayed route
    assert tap.compared == 8 * model.config.num_hidden_layers and tap.agreement < 0.25


def test_a_dense_model_has_no_routers_and_bad_routes_are_refused():
    from transformers import AutoModelForCausalLM
    dense = AutoModelForCausalLM.from_pretrained(tiny_model("qwen2"), dtype=torch.float32)
    assert not RoutingTap(dense).is_moe
    tap = RoutingTap(load("qwen3-moe"))
    with pytest.raises(ValueError, match=r"this model needs \[tokens, 2 layers, top_k\]"):
        with tap.replay(torch.zeros(16, 3, 2, dtype=torch.long)):
            pass
    router = tap.routers[0]
    with pytest.raises(ValueError, match="not laid out as this forward's tokens"):
        with torch.no_grad(), tap.replay(torch.zeros(5, 2, 2, dtype=torch.long)):
            router(torch.zeros(16, router.hidden_dim))  # 16 tokens routed, 5 given
