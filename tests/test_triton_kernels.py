"""Parity of the plugins' Triton kernels with the eager ops.

On a CUDA GPU the kernels are compiled and run there; without one they run in Triton's interpreter
on the CPU (the same kernel code, executed with numpy: it checks what the kernels compute, not how
they compile). Skipped where triton is not installed (the dev extra installs it on Linux x86-64).
"""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # without CUDA, conftest.py set TRITON_INTERPRET=1

from k2deploy.plugins import triton_kernels as tk  # noqa: E402
from k2deploy.plugins.mla import mla_attention_eager  # noqa: E402
from k2deploy.plugins.routing import route  # noqa: E402


@pytest.mark.parametrize("n, m, e, k, n_group, topk_group, normalise", [
    (7, 40, 16, 4, 1, 1, True),  # the tiny preset's shape of routing
    (3, 24, 32, 6, 4, 2, True),  # DeepSeek-V3 style group-limited routing
    (1, 64, 24, 8, 1, 1, False),  # decode, no normalisation, experts not a power of two
])
def test_moe_route_matches_the_eager_op(n, m, e, k, n_group, topk_group, normalise):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, m, generator=g)
    w = torch.randn(e, m, generator=g) * 0.2
    bias = torch.randn(e, generator=g) * 0.1
    expected_w, expected_ids = route(x, w, bias, k, n_group, topk_group, normalise, 2.5)
    got_w, got_ids = tk.moe_route(x.to(DEVICE), w.to(DEVICE), bias.to(DEVICE), k, n_group, topk_group, normalise, 2.5)
    assert torch.equal(got_ids.cpu(), expected_ids)
    torch.testing.assert_close(got_w.cpu(), expected_w, rtol=1e-5, atol=1e-6)


def test_moe_route_ties_go_to_the_lower_expert():
    x = torch.zeros(2, 16)
    w = torch.zeros(8, 16)  # every score is sigmoid(0): the choice is all ties
    got_w, got_ids = tk.moe_route(x.to(DEVICE), w.to(DEVICE), torch.zeros(8, device=DEVICE), 3, 1, 1, True, 1.0)
    assert got_ids.cpu().tolist() == [[0, 1, 2], [0, 1, 2]]


@pytest.mark.parametrize("b, s, past", [(2, 5, 0), (3, 1, 11)], ids=["prefill", "decode"])
def test_mla_attention_matches_the_eager_op(b, s, past):
    g = torch.Generator().manual_seed(1)
    h, d, v, c, r = 4, 8, 8, 32, 16
    t = past + s
    q_nope, q_pe = torch.randn(b, s, h, d, generator=g), torch.randn(b, s, h, r, generator=g)
    latent, rope = torch.randn(b, t, c, generator=g), torch.randn(b, t, r, generator=g)
    w = torch.randn(h * (d + v), c, generator=g) * 0.2
    mask = (torch.arange(t)[None, None, :] <= (past + torch.arange(s))[None, :, None]).expand(b, s, t).clone()
    if past:
        mask[0, :, :2] = False  # a row whose cache holds fewer tokens
    expected = mla_attention_eager(q_nope, q_pe, latent, rope, w, mask, d, v, 0.3)
    got = tk.mla_attention(*(x.to(DEVICE) for x in (q_nope, q_pe, latent, rope, w, mask)), d, v, 0.3)
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-4, atol=1e-5)


def test_mla_decode_over_the_fp8_latent_cache():
    g = torch.Generator().manual_seed(2)
    slots, batch, h, d, v, c, r, group = 9, 2, 4, 8, 8, 32, 16, 16
    latent = torch.randn(slots, batch, c, generator=g)
    grouped = latent.view(slots, batch, c // group, group)
    scale = (grouped.abs().amax(-1, keepdim=True) / 448).clamp(min=1e-12)
    bits = (grouped / scale).to(torch.float8_e4m3fn).view(slots, batch, c)
    rope = torch.randn(slots, batch, r, generator=g).half()
    lengths = torch.tensor([5, 9])
    q_nope, q_pe = torch.randn(batch, 1, h, d, generator=g), torch.randn(batch, 1, h, r, generator=g)
    w = torch.randn(h * (d + v), c, generator=g) * 0.2
    got = tk.mla_decode_fp8(*(x.to(DEVICE) for x in (q_nope, q_pe, bits, scale.squeeze(-1), rope, w, lengths)),
                            d, v, 0.3)
    dequantised = (bits.float().view(slots, batch, c // group, group) * scale).view(slots, batch, c)
    mask = torch.arange(slots)[None, None, :] < lengths[:, None, None]
    expected = mla_attention_eager(q_nope, q_pe, dequantised.transpose(0, 1), rope.float().transpose(0, 1), w, mask,
                                   d, v, 0.3)
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-4, atol=1e-5)


def test_wrappers_check_their_inputs():
    with pytest.raises(ValueError, match="moe_route"):
        tk.moe_route(torch.zeros(2, 3), torch.zeros(4, 5), torch.zeros(4), 2, 1, 1, True, 1.0)
    with pytest.raises(ValueError, match="kv_b_weight"):
        tk.mla_attention(torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4), torch.zeros(1, 3, 8), torch.zeros(1, 3, 4),
                         torch.zeros(5, 8), torch.ones(1, 1, 3, dtype=torch.bool), 4, 4, 0.5)


def _expert_weights(g, e, rows, cols, block, dtype):
    """Random e4m3 bits (every code but the two NaNs) [e, rows, cols] and positive block scales."""
    bits = torch.randint(0, 254, (e, rows, cols), generator=g, dtype=torch.uint8)
    bits[bits == 127] = 126
    scale = torch.rand(e, -(-rows // block), -(-cols // block), generator=g) * 0.02 + 0.001
    return (bits.view(torch.float8_e4m3fn) if dtype == "fp8" else bits), scale


def _close_to_float32_rounding(got, expected):
    """Sums of many large products in another order: equal to 1e-6 of the largest output (float32 has ~6e-8)."""
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6 * float(expected.abs().max()))


@pytest.mark.parametrize("bits_dtype", ["fp8", "uint8"])
@pytest.mark.parametrize("n, k, e, m, f, block", [
    (5, 4, 16, 192, 96, 128),  # the tiny preset: partial FP8 blocks on every side, prefill
    (1, 8, 24, 256, 256, 128),  # decode, whole blocks
    (3, 2, 4, 48, 40, 16),  # small scale blocks: column tiles of 16
])
def test_moe_experts_halves_match_the_eager_op(n, k, e, m, f, block, bits_dtype):
    from k2deploy.plugins.experts import experts_down_eager, experts_eager, experts_up_eager

    g = torch.Generator().manual_seed(2)
    x = torch.randn(n, m, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)])
    weights = torch.rand(n, k, generator=g)
    gate, gate_scale = _expert_weights(g, e, f, m, block, bits_dtype)
    up, up_scale = _expert_weights(g, e, f, m, block, bits_dtype)
    down, down_scale = _expert_weights(g, e, m, f, block, bits_dtype)
    expected_hidden = experts_up_eager(x, ids, gate, gate_scale, up, up_scale, block)
    hidden = tk.moe_experts_up(*(t.to(DEVICE) for t in (x, ids, gate, gate_scale, up, up_scale)), block)
    _close_to_float32_rounding(hidden.cpu(), expected_hidden)
    expected = experts_down_eager(expected_hidden, ids, weights, down, down_scale, block)
    y = tk.moe_experts_down(*(t.to(DEVICE) for t in (expected_hidden, ids, weights, down, down_scale)), block)
    _close_to_float32_rounding(y.cpu(), expected)
    torch.testing.assert_close(expected, experts_eager(x, ids, weights, gate, gate_scale, up, up_scale, down,
                                                       down_scale, block), rtol=0, atol=0)


def test_moe_experts_up_refuses_scales_that_do_not_fit():
    g = torch.Generator().manual_seed(3)
    gate, gate_scale = _expert_weights(g, 4, 32, 64, 16, "uint8")
    with pytest.raises(ValueError, match="one per 16-block"):
        tk.moe_experts_up(torch.zeros(1, 64), torch.zeros(1, 2, dtype=torch.long), gate, gate_scale[:, :1], gate,
                          gate_scale, 16)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # sigmoid(-448) in the interpreter: exp -> inf, 0
def test_the_expert_kernels_decode_every_e4m3_code():
    """Row r of the gate holds code r only and x averages it out, so hidden[r] = silu(value of code r)."""
    from k2deploy.plugins.fp8 import E4M3_VALUES

    codes = torch.arange(256, dtype=torch.uint8)
    codes[[127, 255]] = 0  # the NaN codes
    gate = codes[None, :, None].expand(1, 256, 16).contiguous()
    up = torch.full((1, 256, 16), 0x38, dtype=torch.uint8)  # e4m3 1.0
    scale = torch.ones(1, 16, 1)
    hidden = tk.moe_experts_up(*(t.to(DEVICE) for t in (torch.full((1, 16), 1 / 16), torch.zeros(1, 1, dtype=torch.long),
                                                        gate, scale, up, scale)), 16)
    values = torch.from_numpy(E4M3_VALUES)[codes.long()]
    torch.testing.assert_close(hidden.cpu()[0, 0], torch.nn.functional.silu(values), rtol=1e-6, atol=0)
