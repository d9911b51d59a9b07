"""The plugins' shape and dtype functions (plain Python) for prefill and decode shapes, and their registration."""

import pytest

from k2deploy.plugins.tensorrt import PLUGINS, TensorSpec, output_specs
from k2deploy.plugins.op_spec import BOOL, FLOAT, FP8, INT64, UINT8

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
     "m of x and router_weight disagree"),
    ("MoeRoute", route_inputs(4), {**ROUTE, "n_group": 5}, "does not divide"),
    ("MoeRoute", [TensorSpec((4, M), INT64), *route_inputs(4)[1:]], ROUTE, "must be FLOAT"),
    ("MoeExpertsUp", experts_up_inputs(4)[:-1] + [TensorSpec((E, 3, 3), FLOAT)], {"block": 128},
     "fb of gate_scale and up_scale disagree"),
    ("MoeExpertsUp", experts_up_inputs(4)[:3] + [TensorSpec((E, 3, 3), FLOAT)] + experts_up_inputs(4)[4:5]
     + [TensorSpec((E, 3, 3), FLOAT)], {"block": 128}, "not one scale per 128-block"),
    ("MoeExpertsUp", experts_up_inputs(4)[:4] + [TensorSpec((E, F, M + 1), FP8), TensorSpec(_blocks(F, M + 1), FLOAT)],
     {"block": 128}, "m of x and up_bits disagree"),
    ("MoeExpertsDown", [TensorSpec((4, K, F + 1), FLOAT)] + experts_down_inputs(4)[1:], {"block": 128},
     "f of hidden and down_bits disagree"),
    ("MoeExpertsDown", experts_down_inputs(4)[:2] + [TensorSpec((4, K + 1), FLOAT)] + experts_down_inputs(4)[3:],
     {"block": 128}, "k of hidden and route_weights disagree"),
    ("MlaAttention", attention_inputs(1, 1, 5)[:5] + [TensorSpec((1, 1, 6), BOOL)], ATTN,
     "t of latent and mask disagree"),
    ("MlaAttention", [TensorSpec((1, 1, H, D + 1), FLOAT)] + attention_inputs(1, 1, 5)[1:], ATTN,
     "nope_dim of the attribute and q_nope disagree"),
    ("MlaAttention", attention_inputs(1, 1, 5), {**ATTN, "v_dim": 64}, "kv_b_weight has"),
    ("MlaAttention", attention_inputs(1, 1, 5)[:3], ATTN, "expected 6 inputs"),
    ("MoeExpertsDown", experts_down_inputs(4), {}, "missing attribute"),
])
def test_inputs_that_do_not_fit_are_refused(op, inputs, attributes, message):
    with pytest.raises(ValueError, match=message):
        output_specs(op, inputs, attributes)


def test_the_plugins_are_the_ops_of_the_onnx_domain():
    """Every custom op has plugins; inputs, outputs and attributes of each plugin are those of its ONNX
    function (plugins/), and MoeExperts' two halves take its inputs between them."""
    pytest.importorskip("torch")
    from k2deploy import plugins
    from k2deploy.core.checkpoint.presets import preset_config
    from k2deploy.plugins.tensorrt import DOMAIN_OP_PLUGINS

    config = preset_config("tiny")
    functions = {f.name: f for f in plugins.onnx_functions(config) + plugins.split_functions(config)}
    assert set(DOMAIN_OP_PLUGINS) == {"MoeRoute", "MoeExperts", "MlaAttention"}
    assert {p for names in DOMAIN_OP_PLUGINS.values() for p in names} == set(PLUGINS)
    up, down = (functions[name] for name in DOMAIN_OP_PLUGINS["MoeExperts"])
    assert (set(up.input) | set(down.input)) - {"hidden"} == set(functions["MoeExperts"].input)
    assert list(down.output) == list(functions["MoeExperts"].output) and list(up.output) == ["hidden"]
    for name, plugin in PLUGINS.items():
        function = functions[name]
        assert list(plugin.inputs) == list(function.input) and list(plugin.outputs) == list(function.output)
        assert list(plugin.attributes) == list(function.attribute)
        assert plugin.plugin_id == f"k2deploy::{name}"


def test_registration_needs_tensorrt():
    from k2deploy.core.tensorrt.environment import require_tensorrt
    from k2deploy.core.errors import K2Error

    try:
        require_tensorrt()
    except K2Error as exc:
        pytest.skip(str(exc))
    pytest.importorskip("torch")
    from k2deploy.plugins.tensorrt.registration import plugin_modes, register

    register(aot=False)
    assert set(plugin_modes(True).values()) == {"aot"} and set(plugin_modes(False).values()) == {"jit"}


def test_the_torch_ops_trace_with_the_declared_shapes_and_refuse_what_does_not_fit():
    """torch.export traces each op through the fake kernel its declaration gives."""
    torch = pytest.importorskip("torch")
    from torch._subclasses.fake_tensor import FakeTensorMode

    import k2deploy.plugins  # noqa: F401 - registers the ops

    with FakeTensorMode():
        x, w, bias = torch.empty(5, 64), torch.empty(16, 64), torch.empty(16)
        weights, ids = torch.ops.k2deploy.moe_route(x, w, bias, 4, 1, 1, True, 2.5)
        assert (weights.shape, weights.dtype, ids.shape, ids.dtype) == ((5, 4), torch.float32, (5, 4), torch.int64)
        y = torch.ops.k2deploy.linear_int8(torch.empty(2, 3, 64), torch.empty(8, 2, 32, dtype=torch.uint8),
                                           torch.empty(8, 2))
        assert y.shape == (2, 3, 8) and y.dtype == torch.float32
        with pytest.raises(ValueError, match="m of x and router_weight disagree"):
            torch.ops.k2deploy.moe_route(x, torch.empty(16, 65), bias, 4, 1, 1, True, 2.5)
