"""Triton kernels of the TensorRT plugins: MoE routing, the chosen experts' SwiGLU and down
projection over FP8 weights, and absorbed MLA attention.

Ordinary functions: the `@triton.jit` kernels and wrappers that check their torch inputs and
launch them (`moe_route`, `moe_experts_up`, `moe_experts_down`, `mla_attention`,
`mla_decode_fp8`); `tensorrt/aot.py` compiles the kernels to PTX for the ahead-of-time plugins.
This module imports triton; import it only where triton is installed.

Kernel arguments follow the order TensorRT's AOT plugins launch with: the plugin's input
pointers, then integer scalars, then output pointers; everything else is a constexpr.
"""

from __future__ import annotations

import triton
import triton.language as tl

NEG = tl.constexpr(-1.0e30)  # "minus infinity" that keeps the online softmax free of inf - inf
# Software-pipeline depth of the MLA kernels. At Kimi K2's latent of 512, shared memory per program
# is 109 / 75 / 72 KB for 3 / 2 / 1 stages over a float latent, 136 / 104 / 72 KB over the FP8 cache:
# one stage fits every GPU from Ampere on (Ada allows 99 KB a block).
MLA_STAGES = 1


def next_power_of_2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


# -- MoE routing ----------------------------------------------------------------------------

@triton.jit
def moe_route_kernel(x_ptr, w_ptr, bias_ptr, n_tokens, hidden, experts, weights_ptr, ids_ptr,
                     TOP_K: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, NORMALISE: tl.constexpr,
                     SCALING: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                     BLOCK_G: tl.constexpr):
    """One program per token: scores = sigmoid(x W^T), choice on score + bias (group-limited when
    N_GROUP > 1), top-k with ties to the lower id, weights from the unbiased scores, normalised, scaled."""
    row = tl.program_id(0)
    offs_e = tl.arange(0, BLOCK_E)
    in_e = offs_e < experts
    logits = tl.zeros([BLOCK_E], dtype=tl.float32)
    for m0 in range(0, hidden, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        in_m = offs_m < hidden
        x = tl.load(x_ptr + row * hidden + offs_m, mask=in_m, other=0.0)
        w = tl.load(w_ptr + offs_e[:, None] * hidden + offs_m[None, :], mask=in_e[:, None] & in_m[None, :], other=0.0)
        logits += tl.sum(w * x[None, :], axis=1)
    scores = tl.sigmoid(logits)
    bias = tl.load(bias_ptr + offs_e, mask=in_e, other=0.0)
    choice = tl.where(in_e, scores + bias, float("-inf"))
    if N_GROUP > 1:
        per_group = experts // N_GROUP
        group_of = offs_e // per_group
        offs_g = tl.arange(0, BLOCK_G)
        group_scores = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
        for g in tl.static_range(N_GROUP):
            in_g = in_e & (group_of == g)
            top1 = tl.max(tl.where(in_g, choice, float("-inf")), axis=0)
            first = tl.min(tl.where(in_g & (choice == top1), offs_e, BLOCK_E), axis=0)
            top2 = tl.max(tl.where(in_g & (offs_e != first), choice, float("-inf")), axis=0)
            group_scores = tl.where(offs_g == g, top1 + top2, group_scores)
        kept = tl.zeros([BLOCK_G], dtype=tl.int32)
        for _ in tl.static_range(TOPK_GROUP):
            best = tl.max(group_scores, axis=0)
            pick = tl.min(tl.where(group_scores == best, offs_g, BLOCK_G), axis=0)
            kept = tl.where(offs_g == pick, 1, kept)
            group_scores = tl.where(offs_g == pick, float("-inf"), group_scores)
        keep_e = tl.zeros([BLOCK_E], dtype=tl.int32)
        for g in tl.static_range(N_GROUP):
            kept_g = tl.sum(tl.where(offs_g == g, kept, 0), axis=0)
            keep_e = tl.where(group_of == g, kept_g, keep_e)
        choice = tl.where(keep_e != 0, choice, float("-inf"))
    offs_k = tl.arange(0, BLOCK_K)
    chosen_w = tl.zeros([BLOCK_K], dtype=tl.float32)
    chosen_id = tl.zeros([BLOCK_K], dtype=tl.int64)
    for j in tl.static_range(TOP_K):
        best = tl.max(choice, axis=0)
        pick = tl.min(tl.where(choice == best, offs_e, BLOCK_E), axis=0)
        weight = tl.sum(tl.where(offs_e == pick, scores, 0.0), axis=0)
        chosen_w = tl.where(offs_k == j, weight, chosen_w)
        chosen_id = tl.where(offs_k == j, pick.to(tl.int64), chosen_id)
        choice = tl.where(offs_e == pick, float("-inf"), choice)
    if NORMALISE:
        chosen_w = chosen_w / (tl.sum(chosen_w, axis=0) + 1e-20)
    chosen_w = chosen_w * SCALING
    in_k = offs_k < TOP_K
    tl.store(weights_ptr + row * TOP_K + offs_k, chosen_w, mask=in_k)
    tl.store(ids_ptr + row * TOP_K + offs_k, chosen_id, mask=in_k)


def route_constants(experts: int, hidden: int, top_k: int, n_group: int, topk_group: int, normalise: bool,
                    scaling: float) -> dict:
    return {"TOP_K": int(top_k), "N_GROUP": int(n_group), "TOPK_GROUP": int(topk_group),
            "NORMALISE": int(bool(normalise)), "SCALING": float(scaling), "BLOCK_E": next_power_of_2(experts),
            "BLOCK_M": min(64, next_power_of_2(hidden)), "BLOCK_K": next_power_of_2(top_k),
            "BLOCK_G": next_power_of_2(n_group)}


def moe_route(x, router_weight, correction_bias, top_k: int, n_group: int, topk_group: int, normalise: bool,
              scaling: float):
    """The MoeRoute op on torch tensors: x [n, m], router_weight [e, m], correction_bias [e] (float32) ->
    route_weights [n, k] float32, expert_ids [n, k] int64."""
    import torch

    _need(x.ndim == 2 and router_weight.ndim == 2 and correction_bias.ndim == 1, "moe_route: expected x [n, m], "
          f"router_weight [e, m], correction_bias [e]; got {tuple(x.shape)}, {tuple(router_weight.shape)}, "
          f"{tuple(correction_bias.shape)}")
    n, m = x.shape
    e = router_weight.shape[0]
    _need(router_weight.shape[1] == m and correction_bias.shape[0] == e, "moe_route: sizes disagree")
    _need(e % n_group == 0 and 1 <= topk_group <= n_group and top_k <= topk_group * (e // n_group),
          f"moe_route: bad routing settings for {e} experts")
    _same_device(x, router_weight, correction_bias)
    x, w, bias = (t.contiguous().float() for t in (x, router_weight, correction_bias))
    weights = torch.empty((n, top_k), dtype=torch.float32, device=x.device)
    ids = torch.empty((n, top_k), dtype=torch.int64, device=x.device)
    if n:
        moe_route_kernel[(n,)](x, w, bias, n, m, e, weights, ids,
                               **route_constants(e, m, top_k, n_group, topk_group, normalise, scaling))
    return weights, ids


# -- MoE experts: the chosen experts' SwiGLU, then their weighted down projection ------------
# Two kernels, because an AOT plugin is one launch: MoeExpertsUp writes hidden [n, k, f], then
# MoeExpertsDown reads all of it for each output block. Each program reads only chosen experts.

@triton.jit
def _e4m3(bits):
    """e4m3 bytes -> float32: subnormal m * 2^-9, normal (8 + m) * 2^(e - 10), sign in bit 7.
    Decoded arithmetically, so one kernel takes FP8 or uint8 storage on any GPU (and the interpreter)."""
    b = bits.to(tl.int32) & 255
    exponent = (b >> 3) & 15
    mantissa = (b & 7).to(tl.float32)
    magnitude = tl.where(exponent == 0, mantissa * 0.001953125,
                         (mantissa + 8.0) * tl.exp2((exponent - 10).to(tl.float32)))
    return tl.where(b >= 128, -magnitude, magnitude)


@triton.jit
def _chosen_rows_times(w_ptr, scale_ptr, expert, rows, n_rows, n_cols, v_ptr,
                       QBLOCK: tl.constexpr, BLOCK_C: tl.constexpr):
    """(W_expert v)[rows] -> [BLOCK_R] float32. W [e, n_rows, n_cols] e4m3 bytes, scales [e, ceil(n_rows /
    QBLOCK), ceil(n_cols / QBLOCK)] float32, v [n_cols] float32. BLOCK_C divides QBLOCK: a column tile lies
    in one scale block, so each row's scale multiplies the tile's partial sum, not every weight."""
    row_mask = rows < n_rows
    scale_cols = tl.cdiv(n_cols, QBLOCK)
    scale_row = scale_ptr + (expert * tl.cdiv(n_rows, QBLOCK) + rows // QBLOCK) * scale_cols
    w_row = w_ptr + (expert * n_rows + rows.to(tl.int64)) * n_cols
    acc = tl.zeros(rows.shape, dtype=tl.float32)
    for start in range(0, n_cols, BLOCK_C):
        cols = start + tl.arange(0, BLOCK_C)
        col_mask = cols < n_cols
        v = tl.load(v_ptr + cols, mask=col_mask, other=0.0)
        q = _e4m3(tl.load(w_row[:, None] + cols[None, :], mask=row_mask[:, None] & col_mask[None, :], other=0))
        scale = tl.load(scale_row + start // QBLOCK, mask=row_mask, other=0.0)
        acc += scale * tl.sum(q * v[None, :], axis=1)
    return acc


@triton.jit
def moe_experts_up_kernel(x_ptr, ids_ptr, gate_ptr, gate_scale_ptr, up_ptr, up_scale_ptr, top_k, hidden, width,
                          out_ptr, QBLOCK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Program (pair, row block): out[pair, rows] = silu(G x) * (U x) for token pair // k's expert in slot
    pair % k. x [n, hidden], ids [n, k], gate/up [e, width, hidden] -> out [n, k, width] float32."""
    pair = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    expert = tl.load(ids_ptr + pair)
    x_row = x_ptr + (pair // top_k).to(tl.int64) * hidden
    gate = _chosen_rows_times(gate_ptr, gate_scale_ptr, expert, rows, width, hidden, x_row, QBLOCK, BLOCK_C)
    up = _chosen_rows_times(up_ptr, up_scale_ptr, expert, rows, width, hidden, x_row, QBLOCK, BLOCK_C)
    tl.store(out_ptr + pair.to(tl.int64) * width + rows, gate * tl.sigmoid(gate) * up, mask=rows < width)


@triton.jit
def moe_experts_down_kernel(h_ptr, ids_ptr, weights_ptr, down_ptr, down_scale_ptr, top_k, hidden, width, out_ptr,
                            QBLOCK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Program (token, row block): out[token, rows] = sum over slots of weight * (D_expert h[token, slot])[rows].
    h [n, k, width], ids / weights [n, k], down [e, hidden, width] -> out [n, hidden] float32."""
    token = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for slot in range(0, top_k):
        pair = token * top_k + slot
        expert = tl.load(ids_ptr + pair)
        weight = tl.load(weights_ptr + pair)
        acc += weight * _chosen_rows_times(down_ptr, down_scale_ptr, expert, rows, hidden, width,
                                           h_ptr + pair.to(tl.int64) * width, QBLOCK, BLOCK_C)
    tl.store(out_ptr + token.to(tl.int64) * hidden + rows, acc, mask=rows < hidden)


def experts_constants(block: int) -> dict:
    """QBLOCK: the FP8 scale block; BLOCK_C: the largest power of two up to 64 that divides it."""
    return {"QBLOCK": int(block), "BLOCK_R": 32, "BLOCK_C": min(64, int(block) & -int(block))}


def _check_experts(ids, bits, scale, rows: int, cols: int, block: int, what: str) -> None:
    _need(ids.ndim == 2 and not ids.dtype.is_floating_point, f"{what}: expert_ids must be integer [n, k]")
    _need(bits.ndim == 3 and tuple(bits.shape[1:]) == (rows, cols) and bits.element_size() == 1,
          f"{what}: expected FP8 bits [e, {rows}, {cols}], got {tuple(bits.shape)} {bits.dtype}")
    _need(tuple(scale.shape) == (bits.shape[0], -(-rows // block), -(-cols // block)),
          f"{what}: scales {tuple(scale.shape)} do not hold one per {block}-block of {tuple(bits.shape)}")


def _as_bytes(bits):
    import torch

    return bits.contiguous().view(torch.uint8)


def moe_experts_up(x, expert_ids, gate_bits, gate_scale, up_bits, up_scale, block: int):
    """The MoeExpertsUp plugin on torch tensors: x [n, m] float32, expert_ids [n, k], gate/up bits [e, f, m]
    (float8_e4m3fn or uint8), scales [e, ceil(f/block), ceil(m/block)] -> hidden [n, k, f] float32."""
    import torch

    n, m = x.shape
    f = gate_bits.shape[1]
    _check_experts(expert_ids, gate_bits, gate_scale, f, m, block, "moe_experts_up gate")
    _check_experts(expert_ids, up_bits, up_scale, f, m, block, "moe_experts_up up")
    _same_device(x, expert_ids, gate_bits, gate_scale, up_bits, up_scale)
    k = expert_ids.shape[1]
    out = torch.empty((n, k, f), dtype=torch.float32, device=x.device)
    constants = experts_constants(block)
    if out.numel():
        moe_experts_up_kernel[(n * k, triton.cdiv(f, constants["BLOCK_R"]))](
            x.contiguous().float(), expert_ids.contiguous().long(), _as_bytes(gate_bits), gate_scale.contiguous().float(),
            _as_bytes(up_bits), up_scale.contiguous().float(), k, m, f, out, **constants)
    return out


def moe_experts_down(hidden, expert_ids, route_weights, down_bits, down_scale, block: int):
    """The MoeExpertsDown plugin on torch tensors: hidden [n, k, f] float32, expert_ids / route_weights [n, k],
    down bits [e, m, f], scales [e, ceil(m/block), ceil(f/block)] -> y [n, m] float32."""
    import torch

    n, k, f = hidden.shape
    m = down_bits.shape[1]
    _check_experts(expert_ids, down_bits, down_scale, m, f, block, "moe_experts_down")
    _need(tuple(expert_ids.shape) == tuple(route_weights.shape) == (n, k),
          f"moe_experts_down: expert_ids {tuple(expert_ids.shape)} and route_weights {tuple(route_weights.shape)} "
          f"are not [{n}, {k}]")
    _same_device(hidden, expert_ids, route_weights, down_bits, down_scale)
    out = torch.empty((n, m), dtype=torch.float32, device=hidden.device)
    constants = experts_constants(block)
    if out.numel():
        moe_experts_down_kernel[(n, triton.cdiv(m, constants["BLOCK_R"]))](
            hidden.contiguous().float(), expert_ids.contiguous().long(), route_weights.contiguous().float(),
            _as_bytes(down_bits), down_scale.contiguous().float(), k, m, f, out, **constants)
    return out


# -- absorbed MLA attention -----------------------------------------------------------------

@triton.jit
def _mla_body(q_nope_ptr, q_pe_ptr, latent_ptr, scale_ptr, rope_ptr, w_ptr, mask_ptr, out_ptr,
              seq, keys, heads, stride_lb, stride_lt, stride_sb, stride_st, stride_rb, stride_rt,
              D: tl.constexpr, V: tl.constexpr, C: tl.constexpr, R: tl.constexpr, SOFTMAX_SCALE: tl.constexpr,
              LATENT_FP8: tl.constexpr, GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr,
              BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr):
    row = tl.program_id(0)  # b * seq + s
    b = row // seq
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    in_h = offs_h < heads
    offs_c = tl.arange(0, BLOCK_C)
    in_c = offs_c < C
    offs_r = tl.arange(0, BLOCK_R)
    in_r = offs_r < R
    hc = in_h[:, None] & in_c[None, :]
    # q absorbed into the latent: q_lat[h, c] = sum_d q_nope[h, d] W_uk[h, d, c]
    q_lat = tl.zeros([BLOCK_H, BLOCK_C], dtype=tl.float32)
    for d in range(D):
        qn = tl.load(q_nope_ptr + (row * heads + offs_h) * D + d, mask=in_h, other=0.0)
        wk = tl.load(w_ptr + ((offs_h[:, None] * (D + V) + d) * C + offs_c[None, :]), mask=hc, other=0.0)
        q_lat += qn[:, None] * wk
    q_pe = tl.load(q_pe_ptr + (row * heads + offs_h[:, None]) * R + offs_r[None, :],
                   mask=in_h[:, None] & in_r[None, :], other=0.0)
    m_i = tl.full([BLOCK_H], NEG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_C], dtype=tl.float32)
    for t0 in range(0, keys, BLOCK_T):
        offs_t = t0 + tl.arange(0, BLOCK_T)
        in_t = offs_t < keys
        tc = in_t[:, None] & in_c[None, :]
        lat = tl.load(latent_ptr + b * stride_lb + offs_t[:, None] * stride_lt + offs_c[None, :], mask=tc, other=0.0)
        lat = lat.to(tl.float32)
        if LATENT_FP8:
            lat = lat * tl.load(scale_ptr + b * stride_sb + offs_t[:, None] * stride_st + offs_c[None, :] // GROUP,
                                mask=tc, other=0.0)
        rope = tl.load(rope_ptr + b * stride_rb + offs_t[:, None] * stride_rt + offs_r[None, :],
                       mask=in_t[:, None] & in_r[None, :], other=0.0).to(tl.float32)
        scores = tl.dot(q_lat, tl.trans(lat), input_precision="ieee") + tl.dot(q_pe, tl.trans(rope),
                                                                               input_precision="ieee")
        allowed = tl.load(mask_ptr + row * keys + offs_t, mask=in_t, other=0) != 0
        scores = tl.where(allowed[None, :], scores * SOFTMAX_SCALE, NEG)
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        p = tl.where(allowed[None, :], tl.exp(scores - m_new[:, None]), 0.0)
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, lat, input_precision="ieee")
        m_i = m_new
    acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    # out[h, v] = sum_c acc[h, c] W_uv[h, v, c]
    for v in range(V):
        wv = tl.load(w_ptr + ((offs_h[:, None] * (D + V) + D + v) * C + offs_c[None, :]), mask=hc, other=0.0)
        tl.store(out_ptr + (row * heads + offs_h) * V + v, tl.sum(acc * wv, axis=1), mask=in_h)


@triton.jit
def mla_attention_kernel(q_nope_ptr, q_pe_ptr, latent_ptr, rope_ptr, w_ptr, mask_ptr,
                         seq, keys, heads, stride_lb, stride_lt, stride_rb, stride_rt, out_ptr,
                         D: tl.constexpr, V: tl.constexpr, C: tl.constexpr, R: tl.constexpr,
                         SOFTMAX_SCALE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr,
                         BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr):
    """The MlaAttention plugin: float latent [b, t, c] and rope [b, t, r] (strided), grid (b * s, heads / BLOCK_H)."""
    _mla_body(q_nope_ptr, q_pe_ptr, latent_ptr, latent_ptr, rope_ptr, w_ptr, mask_ptr, out_ptr,
              seq, keys, heads, stride_lb, stride_lt, 0, 0, stride_rb, stride_rt,
              D, V, C, R, SOFTMAX_SCALE, False, 1, BLOCK_H, BLOCK_T, BLOCK_C, BLOCK_R)


@triton.jit
def mla_attention_fp8_kernel(q_nope_ptr, q_pe_ptr, latent_ptr, scale_ptr, rope_ptr, w_ptr, mask_ptr,
                             seq, keys, heads, stride_lb, stride_lt, stride_sb, stride_st, stride_rb, stride_rt,
                             out_ptr, D: tl.constexpr, V: tl.constexpr, C: tl.constexpr, R: tl.constexpr,
                             SOFTMAX_SCALE: tl.constexpr, GROUP: tl.constexpr, BLOCK_H: tl.constexpr,
                             BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr):
    """Absorbed attention straight over the FP8 latent cache: e4m3 latent with one float32 scale per GROUP values."""
    _mla_body(q_nope_ptr, q_pe_ptr, latent_ptr, scale_ptr, rope_ptr, w_ptr, mask_ptr, out_ptr,
              seq, keys, heads, stride_lb, stride_lt, stride_sb, stride_st, stride_rb, stride_rt,
              D, V, C, R, SOFTMAX_SCALE, True, GROUP, BLOCK_H, BLOCK_T, BLOCK_C, BLOCK_R)


def mla_constants(nope_dim: int, v_dim: int, latent_dim: int, rope_dim: int, softmax_scale: float) -> dict:
    # tl.dot needs every block dimension >= 16
    return {"D": int(nope_dim), "V": int(v_dim), "C": int(latent_dim), "R": int(rope_dim),
            "SOFTMAX_SCALE": float(softmax_scale), "BLOCK_H": 16, "BLOCK_T": 16,
            "BLOCK_C": max(16, next_power_of_2(latent_dim)), "BLOCK_R": max(16, next_power_of_2(rope_dim))}


def _check_mla(q_nope, q_pe, kv_b_weight, mask, nope_dim, v_dim, latent_dim, keys):
    _need(q_nope.ndim == 4 and q_pe.ndim == 4 and q_nope.shape[:3] == q_pe.shape[:3],
          f"mla: q_nope [b, s, h, d] and q_pe [b, s, h, r] disagree: {tuple(q_nope.shape)}, {tuple(q_pe.shape)}")
    b, s, h, d = q_nope.shape
    _need(d == nope_dim, f"mla: q_nope's last dim {d} is not nope_dim {nope_dim}")
    _need(tuple(kv_b_weight.shape) == (h * (nope_dim + v_dim), latent_dim),
          f"mla: kv_b_weight {tuple(kv_b_weight.shape)}, expected ({h * (nope_dim + v_dim)}, {latent_dim})")
    _need(tuple(mask.shape) == (b, s, keys), f"mla: mask {tuple(mask.shape)}, expected ({b}, {s}, {keys})")
    return b, s, h


def mla_attention(q_nope, q_pe, latent, rope, kv_b_weight, mask, nope_dim: int, v_dim: int, softmax_scale: float):
    """The MlaAttention op on torch tensors: latent [b, t, c], rope [b, t, r] (any float dtype and strides with
    a unit last stride), mask [b, s, t] bool -> out [b, s, h, v] float32."""
    import torch

    _need(latent.ndim == 3 and rope.ndim == 3 and latent.shape[:2] == rope.shape[:2],
          f"mla_attention: latent [b, t, c] and rope [b, t, r] disagree: {tuple(latent.shape)}, {tuple(rope.shape)}")
    b, s, h = _check_mla(q_nope, q_pe, kv_b_weight, mask, nope_dim, v_dim, latent.shape[2], latent.shape[1])
    _same_device(q_nope, q_pe, latent, rope, kv_b_weight, mask)
    latent, rope = _unit_last_stride(latent), _unit_last_stride(rope)
    q_nope, q_pe, w = (t.contiguous().float() for t in (q_nope, q_pe, kv_b_weight))
    mask = mask.contiguous().to(torch.bool)
    out = torch.empty((b, s, h, v_dim), dtype=torch.float32, device=q_nope.device)
    constants = mla_constants(nope_dim, v_dim, latent.shape[2], rope.shape[2], softmax_scale)
    if out.numel():
        mla_attention_kernel[(b * s, triton.cdiv(h, constants["BLOCK_H"]))](
            q_nope, q_pe, latent, rope, w, mask,
            s, latent.shape[1], h, latent.stride(0), latent.stride(1), rope.stride(0), rope.stride(1), out,
            num_stages=MLA_STAGES, **constants)
    return out


def mla_decode_fp8(q_nope, q_pe, latent, latent_scale, rope, kv_b_weight, lengths, nope_dim: int, v_dim: int,
                   softmax_scale: float):
    """Absorbed attention over the FP8 latent cache, time-major as the layer gathers it from its pages.

    q_nope [b, s, h, d], q_pe [b, s, h, r]; latent [t, b, c] float8_e4m3fn, latent_scale [t, b, c / g] float32,
    rope [t, b, r] float16 (the first t cache slots, the new entries already stored); lengths [b]: row i
    attends to its first lengths[i] slots -> out [b, s, h, v] float32.
    """
    import torch

    _need(latent.dtype == torch.float8_e4m3fn, f"mla_decode_fp8: latent must be float8_e4m3fn, got {latent.dtype}")
    _need(latent.ndim == 3 and latent_scale.ndim == 3 and rope.ndim == 3
          and latent.shape[:2] == latent_scale.shape[:2] == rope.shape[:2],
          "mla_decode_fp8: latent [t, b, c], latent_scale [t, b, c/g] and rope [t, b, r] disagree")
    keys, batch, c = latent.shape
    _need(c % latent_scale.shape[2] == 0, f"mla_decode_fp8: {latent_scale.shape[2]} scales do not divide {c} values")
    mask = torch.arange(keys, device=latent.device)[None, None, :] < lengths.to(latent.device)[:, None, None]
    mask = mask.expand(batch, q_nope.shape[1], keys).contiguous()
    b, s, h = _check_mla(q_nope, q_pe, kv_b_weight, mask, nope_dim, v_dim, c, keys)
    _need(b == batch, f"mla_decode_fp8: {b} query rows, the cache holds {batch}")
    _same_device(q_nope, q_pe, latent, latent_scale, rope, kv_b_weight)
    latent, latent_scale, rope = (_unit_last_stride(t) for t in (latent, latent_scale, rope))
    q_nope, q_pe, w = (t.contiguous().float() for t in (q_nope, q_pe, kv_b_weight))
    out = torch.empty((b, s, h, v_dim), dtype=torch.float32, device=q_nope.device)
    constants = mla_constants(nope_dim, v_dim, c, rope.shape[2], softmax_scale)
    if out.numel():
        mla_attention_fp8_kernel[(b * s, triton.cdiv(h, constants["BLOCK_H"]))](
            q_nope, q_pe, latent, latent_scale.float(), rope, w, mask, s, keys, h,
            latent.stride(1), latent.stride(0), latent_scale.stride(1), latent_scale.stride(0),
            rope.stride(1), rope.stride(0), out, GROUP=c // latent_scale.shape[2], num_stages=MLA_STAGES,
            **constants)
    return out


# -- helpers --------------------------------------------------------------------------------

def _need(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _same_device(*tensors) -> None:
    devices = {t.device for t in tensors}
    _need(len(devices) == 1, f"inputs are on different devices: {sorted(map(str, devices))}")


def _unit_last_stride(t):
    return t if t.stride(-1) == 1 else t.contiguous()
