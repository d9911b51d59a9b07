"""Parity of the plugins' Triton kernels with the eager ops. Needs triton and a CUDA GPU (or TRITON_INTERPRET=1)."""

import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

if torch.cuda.is_available():
    DEVICE = "cuda"
elif os.environ.get("TRITON_INTERPRET") == "1":
    DEVICE = "cpu"  # Triton's interpreter: slow, but the same kernels
else:
    pytest.skip("the Triton kernels need a CUDA GPU (or TRITON_INTERPRET=1 for the interpreter)",
                allow_module_level=True)

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
