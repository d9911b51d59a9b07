"""The plugins' shape and dtype functions (plain Python) for prefill and decode shapes, and their registration."""

import pytest

from k2deploy.plugins.tensorrt import PLUGINS, TensorSpec, output_specs
from k2deploy.plugins.tensorrt.descriptors import BOOL, FLOAT, FP8, INT64, UINT8

# Kimi K2's dimensions: hidden 7168, 384 experts top-8, expert width 2048, 64 heads, latent 512, rope 64
M, E, K, F, H, D, V, C, R = 7168, 384, 8, 2048, 64, 128, 128, 512, 64
ROUTE = dict(top_k=K, n_group=1, topk_group=1, normalise=1, scaling=2.827)
ATTN = dict(nope_dim=D, v_dim=V, softmax_scale=0.1352)


def route_inputs(n):
    return [TensorSpec((n, M), FLOAT), TensorSpec((E, M), FLOAT), TensorSpec((E,), FLOAT)]


def _blocks(rows, cols):
    return (E, -(-rows // 128), -(-cols // 128))


def experts_up_inputs(n, bits=FP8):
    return [TensorSpec((n, M), FLOAT), TensorSpec((n, K), INT64), TensorSpec((E, F, M), bits),
            TensorSpec(_blocks(F, M), FLOAT), TensorSpec((E, F, M), bits), TensorSpec(_blocks(F, M), FLOAT)]


def experts_down_inputs(n, bits=FP8):
    return [TensorSpec((n, K, F), FLOAT), TensorSpec((n, K), INT64), TensorSpec((n, K), FLOAT),
            TensorSpec((E, M, F), bits), TensorSpec(_blocks(M, F), FLOAT)]


def attention_inputs(b, s, t):
    return [TensorSpec((b, s, H, D), FLOAT), TensorSpec((b, s, H, R), FLOAT), TensorSpec((b, t, C), FLOAT),
            TensorSpec((b, t, R), FLOAT), TensorSpec((H * (D + V), C), FLOAT), TensorSpec((b, s, t), BOOL)]


# prefill: 2 rows of 37 new tokens on an empty cache; decode: 8 rows, one token after 1000 cached
SHAPES = {"prefill": (2, 37, 0), "decode": (8, 1, 1000)}


@pytest.mark.parametrize("phase", SHAPES)
def test_moe_route_outputs(phase):
    b, s, _ = SHAPES[phase]
    assert output_specs("MoeRoute", route_inputs(b * s), ROUTE) == [TensorSpec((b * s, K), FLOAT),
                                                                    TensorSpec((b * s, K), INT64)]


@pytest.mark.parametrize("phase", SHAPES)
@pytest.mark.parametrize("bits", [FP8, UINT8])
def test_moe_experts_outputs(phase, bits):
    """MoeExperts runs as two plugins: the chosen experts' SwiGLU [n, k, f], then their weighted sum [n, m]."""
    b, s, _ = SHAPES[phase]
    assert output_specs("MoeExpertsUp", experts_up_inputs(b * s, bits), {"block": 128}) == [
        TensorSpec((b * s, K, F), FLOAT)]
    assert output_specs("MoeExpertsDown", experts_down_inputs(b * s, bits), {"block": 128}) == [
        TensorSpec((b * s, M), FLOAT)]


@pytest.mark.parametrize("phase", SHAPES)
def test_mla_attention_outputs(phase):
    b, s, past = SHAPES[phase]
    assert output_specs("MlaAttention", attention_inputs(b, s, past + s), ATTN) == [TensorSpec((b, s, H, V), FLOAT)]


def test_symbolic_dimensions_pass_through():
    """TensorRT hands the functions symbolic dims; names stand in for them here."""
    inputs = [TensorSpec(("b", "s", H, D), FLOAT), TensorSpec(("b", "s", H, R), FLOAT),
              TensorSpec(("b", "t", C), FLOAT),
              TensorSpec(("b", "t", R), FLOAT), TensorSpec((H * (D + V), C), FLOAT), TensorSpec(("b", "s", "t"), BOOL)]
    assert output_specs("MlaAttention", inputs, ATTN) == [TensorSpec(("b", "s", H, V), FLOAT)]
    assert output_specs("MoeRoute", [TensorSpec(("n", M), FLOAT), *route_inputs(1)[1:]], ROUTE)[1] == \
        TensorSpec(("n", K), INT64)


@pytest.mark.parametrize("op, inputs, attributes, message", [
    ("MoeRoute", [TensorSpec((4, M), FLOAT), TensorSpec((E, M + 1), FLOAT), TensorSpec((E,), FLOAT)], ROUTE,
     "hidden sizes"),
    ("MoeRoute", route_inputs(4), {**ROUTE, "n_group": 5}, "does not divide"),
    ("MoeRoute", [TensorSpec((4, M), INT64), *route_inputs(4)[1:]], ROUTE, "must be FLOAT"),
    ("MoeExpertsUp", experts_up_inputs(4)[:-1] + [TensorSpec((E, 3, 3), FLOAT)], {"block": 128}, "one scale per"),
    ("MoeExpertsUp", experts_up_inputs(4)[:4] + [TensorSpec((E, F, M + 1), FP8), TensorSpec(_blocks(F, M + 1), FLOAT)],
     {"block": 128}, "dim 2 of gate_bits and up_bits"),
    ("MoeExpertsDown", [TensorSpec((4, K, F + 1), FLOAT)] + experts_down_inputs(4)[1:], {"block": 128},
     "expert widths of hidden and down_bits"),
    ("MoeExpertsDown", experts_down_inputs(4)[:2] + [TensorSpec((4, K + 1), FLOAT)] + experts_down_inputs(4)[3:],
     {"block": 128}, "k of expert_ids and route_weights"),
    ("MlaAttention", attention_inputs(1, 1, 5)[:5] + [TensorSpec((1, 1, 6), BOOL)], ATTN, "key positions"),
    ("MlaAttention", attention_inputs(1, 1, 5), {**ATTN, "v_dim": 64}, "kv_b_weight has"),
    ("MlaAttention", attention_inputs(1, 1, 5)[:3], ATTN, "expected 6 inputs"),
    ("MoeExpertsDown", experts_down_inputs(4), {}, "missing attribute"),
])
def test_inputs_that_do_not_fit_are_refused(op, inputs, attributes, message):
    with pytest.raises(ValueError, match=message):
        output_specs(op, inputs, attributes)


def test_the_plugins_are_the_ops_of_the_onnx_domain():
    """Every custom op has plugins; inputs, outputs and attributes of each plugin are those of its ONNX
    function (plugins/); MoeExperts' two halves take its inputs between them."""
    pytest.importorskip("torch")
    from k2deploy.plugins.experts import EXPERTS, EXPERTS_DOWN, EXPERTS_UP
    from k2deploy.plugins.mla import ATTENTION
    from k2deploy.plugins.routing import ROUTE as ROUTE_SPEC
    from k2deploy.plugins.tensorrt import DOMAIN_OP_PLUGINS

    assert set(DOMAIN_OP_PLUGINS) == {ROUTE_SPEC.name, EXPERTS.name, ATTENTION.name}
    assert {p for plugins in DOMAIN_OP_PLUGINS.values() for p in plugins} == set(PLUGINS)
    assert set(EXPERTS_UP.inputs + EXPERTS_DOWN.inputs) - {"hidden"} == set(EXPERTS.inputs)
    assert EXPERTS_DOWN.outputs == EXPERTS.outputs and EXPERTS_UP.outputs == ["hidden"]
    for spec in (ROUTE_SPEC, EXPERTS_UP, EXPERTS_DOWN, ATTENTION):
        plugin = PLUGINS[spec.name]
        assert list(plugin.inputs) == spec.inputs and list(plugin.outputs) == spec.outputs
        assert sorted(plugin.attributes) == sorted(spec.attributes)
        assert plugin.plugin_id == f"k2deploy::{spec.name}"


def test_registration_needs_tensorrt():
    from k2deploy.runtime.tensorrt import require_tensorrt
    from k2deploy.core.errors import K2Error

    try:
        require_tensorrt()
    except K2Error as exc:
        pytest.skip(str(exc))
    pytest.importorskip("torch")
    from k2deploy.plugins.tensorrt.registration import plugin_modes, register

    register(aot=False)
    assert set(plugin_modes(True).values()) == {"aot"} and set(plugin_modes(False).values()) == {"jit"}
