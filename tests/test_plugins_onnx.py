"""The ONNX function bodies of the custom ops, run by ONNX Runtime (CPU), against their eager twins.

Each test builds a one-node model (domain `k2deploy`, version 1) that carries the op's
model-local FunctionProto, with every graph dimension symbolic, and compares ORT's output
with the eager torch implementation.

Tolerances (float32): routing weights and MLA outputs atol 1e-5, rtol 1e-4; expert ids must be
identical; expert outputs within 1e-5 relative to the largest output magnitude (the two faces
sum the same products in different orders; element-wise relative error is meaningless for
outputs that cancel to ~0).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from onnx import TensorProto, helper  # noqa: E402

from k2deploy.plugins.experts import experts_eager, moe_experts_function  # noqa: E402
from k2deploy.plugins.mla import mla_attention_eager, mla_attention_function  # noqa: E402
from k2deploy.plugins.onnx_domain import BODY_OPSET, DOMAIN, VERSION  # noqa: E402
from k2deploy.plugins.routing import moe_route_function, route  # noqa: E402
from k2deploy.runtime.backends.onnx.thread_pool import session_options  # noqa: E402

ATOL, RTOL = 1e-5, 1e-4  # float32 comparisons (routing weights, MLA)
EXPERTS_REL = 1e-5  # experts: max |ort - eager| <= 1e-5 * max |eager|
BLOCK = 128


def test_domain_constants():
    assert (DOMAIN, VERSION, BODY_OPSET) == ("k2deploy", 1, 21)


# -- harness ----------------------------------------------------------------------------------

def _value_info(name: str, elem_type: int, dims: list[str]) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem_type, dims)


def _one_node_model(function: onnx.FunctionProto, inputs: list[onnx.ValueInfoProto],
                    outputs: list[onnx.ValueInfoProto], attributes: dict) -> onnx.ModelProto:
    node = helper.make_node(function.name, [i.name for i in inputs], [o.name for o in outputs], domain=DOMAIN,
                            **attributes)
    graph = helper.make_graph([node], f"{function.name}_test", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(DOMAIN, 1)])
    model.ir_version = 10  # what onnxruntime >= 1.20 reads; opset 21 needs IR >= 10
    model.functions.append(function)
    onnx.checker.check_model(model)
    return model


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), session_options(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def _close(actual: np.ndarray, expected: torch.Tensor, atol: float = ATOL, rtol: float = RTOL) -> float:
    expected = expected.detach().numpy()
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    assert np.isfinite(expected).all()
    np.testing.assert_allclose(actual, expected, atol=atol, rtol=rtol)
    return float(np.abs(actual - expected).max())


# -- routing ----------------------------------------------------------------------------------

ROUTE_INPUTS = [
    _value_info("x", TensorProto.FLOAT, ["n", "m"]),
    _value_info("router_weight", TensorProto.FLOAT, ["e", "m"]),
    _value_info("correction_bias", TensorProto.FLOAT, ["e"]),
]
ROUTE_OUTPUTS = [
    _value_info("route_weights", TensorProto.FLOAT, ["n", "k"]),
    _value_info("expert_ids", TensorProto.INT64, ["n", "k"]),
]


def _route_both(x, weight, bias, top_k, n_group=1, topk_group=1, normalise=True, scaling=1.0):
    """(ort weights, ort ids) as numpy, (eager weights, eager ids) as torch."""
    function = moe_route_function(top_k, n_group, topk_group, normalise, scaling)
    model = _one_node_model(function, ROUTE_INPUTS, ROUTE_OUTPUTS,
                            {"top_k": top_k, "n_group": n_group, "topk_group": topk_group,
                             "normalise": int(normalise), "scaling": scaling})
    ort_weights, ort_ids = _run(model, {"x": x.numpy(), "router_weight": weight.numpy(),
                                        "correction_bias": bias.numpy()})
    eager_weights, eager_ids = route(x, weight, bias, top_k, n_group, topk_group, normalise, scaling)
    return ort_weights, ort_ids, eager_weights, eager_ids


def _assert_same_route(ort_weights, ort_ids, eager_weights, eager_ids) -> float:
    assert ort_ids.dtype == np.int64
    np.testing.assert_array_equal(ort_ids, eager_ids.numpy())
    return _close(ort_weights, eager_weights)


@pytest.mark.parametrize("n, m, e, top_k, normalise, scaling", [
    (1, 64, 16, 4, True, 2.5),     # a single token
    (7, 192, 32, 6, True, 1.0),
    (33, 96, 64, 8, False, 2.827),
    (5, 320, 24, 1, True, 1.0),    # top-1 with normalisation: weight 1 * scaling
])
def test_route_random(n, m, e, top_k, normalise, scaling):
    g = torch.Generator().manual_seed(n * 1000 + e)
    x = torch.randn(n, m, generator=g)
    weight = torch.randn(e, m, generator=g) / m ** 0.5
    bias = torch.randn(e, generator=g) * 0.05
    ow, oi, ew, ei = _route_both(x, weight, bias, top_k, normalise=normalise, scaling=scaling)
    assert oi.shape == (n, top_k)
    assert all(len(set(row)) == top_k for row in oi.tolist())
    _assert_same_route(ow, oi, ew, ei)


def _dyadic(shape, generator, scale: int = 8) -> torch.Tensor:
    """Small multiples of 1/scale: every product and sum of a short dot product is exact in float32,
    so scores that tie mathematically tie bit for bit in any summation order."""
    return torch.randint(-scale, scale + 1, shape, generator=generator).float() / scale


def test_route_exact_ties_go_to_the_lower_expert_id():
    g = torch.Generator().manual_seed(1)
    n, m, e, top_k = 9, 64, 16, 4
    x = _dyadic((n, m), g)
    base = _dyadic((e // 4, m), g)
    weight = base.repeat(4, 1)  # experts i, i+4, i+8, i+12 have the same row: every score appears 4 times
    bias = torch.zeros(e)
    scores = torch.sigmoid(x @ weight.T)
    assert torch.equal(scores[:, :4].repeat(1, 4), scores)  # the ties are exact
    ow, oi, ew, ei = _route_both(x, weight, bias, top_k, normalise=False)
    _assert_same_route(ow, oi, ew, ei)
    # each token's best score is held by at least 4 experts; the 4 lowest ids among them win, in id order
    for row, token_scores in zip(oi.tolist(), scores):
        holders = (token_scores == token_scores.max()).nonzero().flatten().tolist()
        assert row == holders[:top_k]


def test_route_partial_ties_with_bias_keep_the_lower_id():
    """Ties that only some of the tied experts can win: 2 of the 3 experts tied at the cut-off are kept."""
    n, m, e, top_k = 4, 8, 8, 3
    x = torch.ones(n, m) / 8
    weight = torch.zeros(e, m)
    bias = torch.tensor([0.0, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    bias[[6, 3, 5]] = 0.25  # tied at the cut-off: 3, 5, 6 share the value; only 3 and 5 fit
    ow, oi, ew, ei = _route_both(x, weight, bias, top_k, normalise=True)
    _assert_same_route(ow, oi, ew, ei)
    assert oi.tolist() == [[1, 3, 5]] * n


def test_route_correction_bias_overturns_the_raw_top_k():
    g = torch.Generator().manual_seed(2)
    n, m, e, top_k = 12, 192, 32, 4
    x = torch.randn(n, m, generator=g)
    weight = torch.randn(e, m, generator=g) / m ** 0.5
    bias = torch.zeros(e)
    bias[e // 2:] = 0.6  # lifts the upper half above nearly every raw top-k choice
    zero = torch.zeros(e)
    ow, oi, ew, ei = _route_both(x, weight, bias, top_k, normalise=True, scaling=2.0)
    _assert_same_route(ow, oi, ew, ei)
    ow0, oi0, ew0, ei0 = _route_both(x, weight, zero, top_k, normalise=True, scaling=2.0)
    _assert_same_route(ow0, oi0, ew0, ei0)
    changed = (np.sort(oi, -1) != np.sort(oi0, -1)).any(-1)
    assert changed.sum() >= n // 2, "the bias must change the choice for most tokens"
    # chosen by score + bias, weighed by the raw sigmoid score
    scores = torch.sigmoid(x @ weight.T)
    expected = scores.gather(1, torch.from_numpy(oi))
    expected = expected / expected.sum(-1, keepdim=True) * 2.0
    _close(ow, expected)


@pytest.mark.parametrize("n, e, top_k", [(1, 16, 4), (10, 32, 6), (6, 64, 8)])
def test_route_grouped(n, e, top_k):
    n_group, topk_group = 4, 2
    g = torch.Generator().manual_seed(3 + e)
    m = 96
    x = torch.randn(n, m, generator=g)
    weight = torch.randn(e, m, generator=g) / m ** 0.5
    bias = torch.randn(e, generator=g) * 0.05
    ow, oi, ew, ei = _route_both(x, weight, bias, top_k, n_group=n_group, topk_group=topk_group, scaling=2.5)
    _assert_same_route(ow, oi, ew, ei)
    per_group = e // n_group
    groups = oi // per_group
    assert all(len(set(row)) <= topk_group for row in groups.tolist())
    # the 2 groups kept are those with the largest sum of their 2 best (score + bias)
    choice = (torch.sigmoid(x @ weight.T) + bias).view(n, n_group, per_group)
    best_groups = choice.topk(2, dim=-1).values.sum(-1).topk(topk_group, dim=-1).indices
    for row, kept in zip(groups.tolist(), best_groups.tolist()):
        assert set(row) <= set(kept)
    # the grouping matters here: without it, some token would take experts from a third group
    _, ungrouped, _, _ = _route_both(x, weight, bias, top_k, scaling=2.5)
    assert any(len(set(row)) > topk_group for row in (ungrouped // per_group).tolist())


def test_route_grouped_tied_group_scores():
    """Two groups with exactly equal group scores: the lower group id is kept in both faces."""
    n, m, e, top_k = 3, 32, 16, 4
    g = torch.Generator().manual_seed(4)
    x = _dyadic((n, m), g)
    block = _dyadic((4, m), g)
    weight = torch.cat([block, block, block, block])  # the 4 groups are copies of each other
    bias = torch.zeros(e)
    bias[0:4] = -0.75  # group 0 falls behind; groups 1, 2, 3 tie
    ow, oi, ew, ei = _route_both(x, weight, bias, top_k, n_group=4, topk_group=2, normalise=False)
    _assert_same_route(ow, oi, ew, ei)
    assert set((oi // 4).flatten().tolist()) == {1, 2}


# -- experts ----------------------------------------------------------------------------------

def _e4m3_bits(shape, generator) -> torch.Tensor:
    """Random finite e4m3 bit patterns (0x7f and 0xff are NaN)."""
    bits = torch.randint(0, 254, shape, generator=generator)
    bits = bits + (bits >= 0x7F).long()  # skip 0x7f; 0xff is out of range
    return bits.to(torch.uint8)


def _block_scales(e: int, rows: int, cols: int, generator) -> torch.Tensor:
    """Scales that differ by up to 4x from block to block, so a wrong block index shows."""
    shape = (e, -(-rows // BLOCK), -(-cols // BLOCK))
    return (0.25 + 0.75 * torch.rand(shape, generator=generator)) * (0.5 / 448)


def _expert_weights(e: int, f: int, m: int, generator) -> dict[str, torch.Tensor]:
    return {
        "gate_bits": _e4m3_bits((e, f, m), generator), "gate_scale": _block_scales(e, f, m, generator),
        "up_bits": _e4m3_bits((e, f, m), generator), "up_scale": _block_scales(e, f, m, generator),
        "down_bits": _e4m3_bits((e, m, f), generator), "down_scale": _block_scales(e, m, f, generator),
    }


EXPERT_INPUTS = [
    _value_info("x", TensorProto.FLOAT, ["n", "m"]),
    _value_info("expert_ids", TensorProto.INT64, ["n", "k"]),
    _value_info("route_weights", TensorProto.FLOAT, ["n", "k"]),
    _value_info("gate_bits", TensorProto.UINT8, ["e", "f", "m"]),
    _value_info("gate_scale", TensorProto.FLOAT, ["e", "fb", "mb"]),
    _value_info("up_bits", TensorProto.UINT8, ["e", "f", "m"]),
    _value_info("up_scale", TensorProto.FLOAT, ["e", "fb", "mb"]),
    _value_info("down_bits", TensorProto.UINT8, ["e", "m", "f"]),
    _value_info("down_scale", TensorProto.FLOAT, ["e", "mb", "fb"]),
]
EXPERT_OUTPUTS = [_value_info("y", TensorProto.FLOAT, ["n", "m"])]


def _experts_model(e: int, f: int, m: int, function: onnx.FunctionProto | None = None) -> onnx.ModelProto:
    function = function or moe_experts_function(e, f, m, BLOCK)
    return _one_node_model(function, EXPERT_INPUTS, EXPERT_OUTPUTS, {"block": BLOCK})


def _experts_case(n: int, k: int, e: int, f: int, m: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, m, generator=g)
    expert_ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)])  # distinct per token
    route_weights = torch.rand(n, k, generator=g) + 0.1
    return x, expert_ids, route_weights, _expert_weights(e, f, m, g)


def _experts_feeds(x, expert_ids, route_weights, weights) -> dict[str, np.ndarray]:
    return {"x": x.numpy(), "expert_ids": expert_ids.numpy(), "route_weights": route_weights.numpy(),
            **{name: t.numpy() for name, t in weights.items()}}


def _experts_eager(x, expert_ids, route_weights, weights) -> torch.Tensor:
    w = weights
    return experts_eager(x, expert_ids, route_weights, w["gate_bits"], w["gate_scale"], w["up_bits"], w["up_scale"],
                         w["down_bits"], w["down_scale"], BLOCK)


EXPERT_CASES = [
    # n, k, e, f, m             (f, m not multiples of 128: partial edge blocks)
    (1, 4, 8, 96, 192),         # gathered: one decode token
    (2, 3, 8, 256, 384),        # gathered, rows in whole blocks: scales applied to the vector
    (1, 2, 4, 128, 130),        # gathered, whole row blocks, a partial column block
    (2, 4, 8, 320, 192),        # gathered: n*k == e exactly
    (3, 2, 16, 320, 130),       # gathered
    (3, 3, 8, 96, 192),         # dense: n*k = 9 > 8, just over the threshold
    (8, 4, 8, 320, 192),        # dense
    (17, 2, 6, 96, 257),        # dense, three column blocks, the last of width 1
]


@pytest.mark.parametrize("n, k, e, f, m", EXPERT_CASES)
def test_experts_match_eager(n, k, e, f, m):
    x, expert_ids, route_weights, weights = _experts_case(n, k, e, f, m, seed=n + 10 * k + 100 * e + f + m)
    (y,) = _run(_experts_model(e, f, m), _experts_feeds(x, expert_ids, route_weights, weights))
    expected = _experts_eager(x, expert_ids, route_weights, weights)
    scale = float(expected.abs().max())
    assert scale > 0.1  # an informative output, not all zeros
    _close(y, expected, atol=EXPERTS_REL * scale, rtol=0)


def _marked_branches(function: onnx.FunctionProto, then_value: float, else_value: float) -> onnx.FunctionProto:
    """A copy of the function whose If branches each return a constant [n, m] marker."""
    function = copy.deepcopy(function)
    (if_node,) = [node for node in function.node if node.op_type == "If"]

    def marker(name: str, value: float) -> onnx.GraphProto:
        nodes = [
            helper.make_node("Constant", [], [f"{name}_zero"], value=helper.make_tensor("v", TensorProto.FLOAT, [], [0.0])),
            helper.make_node("Constant", [], [f"{name}_mark"], value=helper.make_tensor("v", TensorProto.FLOAT, [], [value])),
            helper.make_node("Mul", ["x", f"{name}_zero"], [f"{name}_zeros"]),
            helper.make_node("Add", [f"{name}_zeros", f"{name}_mark"], [f"{name}_y"]),
        ]
        return helper.make_graph(nodes, name, [], [_value_info(f"{name}_y", TensorProto.FLOAT, ["n", "m"])])

    for attribute in if_node.attribute:
        if attribute.name == "then_branch":
            attribute.g.CopyFrom(marker("then_mark", then_value))
        elif attribute.name == "else_branch":
            attribute.g.CopyFrom(marker("else_mark", else_value))
    return function


@pytest.mark.parametrize("n, k, e, f, m", EXPERT_CASES)
def test_experts_branch_taken(n, k, e, f, m):
    """The cases above do exercise both bodies: the dense one (then) exactly when n * k > e."""
    x, expert_ids, route_weights, weights = _experts_case(n, k, e, f, m, seed=0)
    marked = _marked_branches(moe_experts_function(e, f, m, BLOCK), then_value=1.0, else_value=2.0)
    (y,) = _run(_experts_model(e, f, m, marked), _experts_feeds(x, expert_ids, route_weights, weights))
    assert np.all(y == (1.0 if n * k > e else 2.0))


def test_experts_branches_agree_with_each_other():
    """The same tokens through both bodies: 2 tokens (gathered) vs those 2 tokens padded to 5 (dense)."""
    n, k, e, f, m = 5, 2, 8, 320, 192
    x, expert_ids, route_weights, weights = _experts_case(n, k, e, f, m, seed=7)
    model = _experts_model(e, f, m)
    (dense,) = _run(model, _experts_feeds(x, expert_ids, route_weights, weights))
    (gathered,) = _run(model, _experts_feeds(x[:2], expert_ids[:2], route_weights[:2], weights))
    scale = float(np.abs(dense[:2]).max())
    np.testing.assert_allclose(gathered, dense[:2], atol=EXPERTS_REL * scale, rtol=0)


def test_experts_block_scales_are_applied_per_block():
    """Scaling one edge block of one expert changes the output (the body reads each block's scale)."""
    n, k, e, f, m = 2, 2, 4, 320, 192
    x, expert_ids, route_weights, weights = _experts_case(n, k, e, f, m, seed=8)
    expert_ids = torch.tensor([[1, 2], [1, 3]])
    model = _experts_model(e, f, m)
    (before,) = _run(model, _experts_feeds(x, expert_ids, route_weights, weights))
    changed = dict(weights)
    changed["down_scale"] = weights["down_scale"].clone()
    changed["down_scale"][1, 1, 2] *= 3  # expert 1, rows 128..191 (partial), cols 256..319 (partial)
    (after,) = _run(model, _experts_feeds(x, expert_ids, route_weights, changed))
    expected = _experts_eager(x, expert_ids, route_weights, changed)
    scale = float(expected.abs().max())
    _close(after, expected, atol=EXPERTS_REL * scale, rtol=0)
    diff = np.abs(after - before) > 1e-6
    assert diff[:, 128:].any() and not diff[:, :128].any()  # only the rows of that block moved


# -- MLA attention ----------------------------------------------------------------------------

MLA_INPUTS = [
    _value_info("q_nope", TensorProto.FLOAT, ["b", "s", "h", "d"]),
    _value_info("q_pe", TensorProto.FLOAT, ["b", "s", "h", "r"]),
    _value_info("latent", TensorProto.FLOAT, ["b", "t", "c"]),
    _value_info("rope", TensorProto.FLOAT, ["b", "t", "r"]),
    _value_info("kv_b_weight", TensorProto.FLOAT, ["hdv", "c"]),
    _value_info("mask", TensorProto.BOOL, ["b", "s", "t"]),
]
MLA_OUTPUTS = [_value_info("out", TensorProto.FLOAT, ["b", "s", "h", "v"])]


def _mla_inputs(b, s, t, h, d, v, r, c, seed):
    g = torch.Generator().manual_seed(seed)
    return {
        "q_nope": torch.randn(b, s, h, d, generator=g),
        "q_pe": torch.randn(b, s, h, r, generator=g),
        "latent": torch.randn(b, t, c, generator=g),
        "rope": torch.randn(b, t, r, generator=g),
        "kv_b_weight": torch.randn(h * (d + v), c, generator=g) / c ** 0.5,
    }


def _causal_mask(lengths: list[int], s: int, t: int) -> torch.Tensor:
    """Row i of the new positions of batch row j sees keys 0 .. lengths[j] - s + i (its cache and itself)."""
    keys = torch.arange(t)
    return torch.stack([keys[None, :] <= (length - s + torch.arange(s))[:, None] for length in lengths])


def _mla_both(inputs: dict, mask: torch.Tensor, h: int, d: int, v: int, r: int):
    scale = (d + r) ** -0.5
    model = _one_node_model(mla_attention_function(h, d, v, scale), MLA_INPUTS, MLA_OUTPUTS,
                            {"nope_dim": d, "v_dim": v, "softmax_scale": scale})
    (out,) = _run(model, {**{k: t.numpy() for k, t in inputs.items()}, "mask": mask.numpy()})
    expected = mla_attention_eager(inputs["q_nope"], inputs["q_pe"], inputs["latent"], inputs["rope"],
                                   inputs["kv_b_weight"], mask, d, v, scale)
    return out, expected


@pytest.mark.parametrize("b, s, t, lengths, h, d, v, r, c", [
    (3, 4, 10, [10, 6, 4], 4, 16, 16, 8, 32),       # prefill rows of different valid lengths
    (2, 1, 17, [17, 5], 2, 32, 24, 16, 64),         # decode: a single new token
    (1, 3, 3, [3], 8, 8, 8, 4, 16),                 # no cache: plain causal prefill
    (2, 1, 512, [512, 512], 4, 32, 32, 16, 64),     # a cache at its maximum length, every key valid
    (2, 2, 512, [512, 300], 2, 16, 16, 8, 48),      # a long cache, one row partly filled
])
def test_mla_matches_eager(b, s, t, lengths, h, d, v, r, c):
    inputs = _mla_inputs(b, s, t, h, d, v, r, c, seed=b + s + t + h)
    mask = _causal_mask(lengths, s, t)
    assert mask.any(-1).all()  # every query sees at least one key
    out, expected = _mla_both(inputs, mask, h, d, v, r)
    assert out.shape == (b, s, h, v)
    _close(out, expected)


def test_mla_masked_keys_have_no_influence():
    b, s, t, h, d, v, r, c = 3, 2, 24, 4, 16, 16, 8, 32
    inputs = _mla_inputs(b, s, t, h, d, v, r, c, seed=11)
    mask = _causal_mask([24, 13, 5], s, t)
    assert not mask.all()  # some keys are masked
    out, expected = _mla_both(inputs, mask, h, d, v, r)
    _close(out, expected)
    # rewrite every masked key's latent and rope (masked for every query of its row)
    g = torch.Generator().manual_seed(12)
    hidden = ~mask.any(1)  # [b, t]
    changed = dict(inputs)
    changed["latent"] = torch.where(hidden[..., None], 100 * torch.randn(b, t, c, generator=g), inputs["latent"])
    changed["rope"] = torch.where(hidden[..., None], 100 * torch.randn(b, t, r, generator=g), inputs["rope"])
    assert not torch.equal(changed["latent"], inputs["latent"])
    out2, expected2 = _mla_both(changed, mask, h, d, v, r)
    np.testing.assert_array_equal(out2, out)  # weights exactly 0: not one bit moves
    torch.testing.assert_close(expected2, expected, rtol=0, atol=0)
    # ... whereas the same change with those keys visible does move the output
    out3, _ = _mla_both(changed, torch.ones_like(mask), h, d, v, r)
    out4, _ = _mla_both(inputs, torch.ones_like(mask), h, d, v, r)
    assert np.abs(out3 - out4).max() > 1e-2


def test_mla_mask_rows_differ_within_a_batch():
    """A key masked for one query but visible to the next, in the same batch row, is honoured per query."""
    b, s, t, h, d, v, r, c = 1, 2, 6, 2, 8, 8, 4, 16
    inputs = _mla_inputs(b, s, t, h, d, v, r, c, seed=13)
    mask = _causal_mask([6], s, t)  # query 0 sees keys 0..4, query 1 sees 0..5
    out, expected = _mla_both(inputs, mask, h, d, v, r)
    _close(out, expected)
    changed = dict(inputs)
    changed["latent"] = inputs["latent"].clone()
    changed["latent"][0, 5] += 5.0
    out2, _ = _mla_both(changed, mask, h, d, v, r)
    np.testing.assert_array_equal(out2[:, 0], out[:, 0])
    assert np.abs(out2[:, 1] - out[:, 1]).max() > 1e-2
