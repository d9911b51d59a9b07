"""The eager PyTorch reference of the Kimi K2 / DeepSeek-V3 architecture, in float32.

Modules are named after the paper (MLA, Gate, MoE, Block) and their parameters after the
checkpoint's tensors, so that `model.layers.{i}.` + a parameter name is the tensor it holds.
Routed experts are the exception: they are stacked into [e, ...] tensors.

`Block` is the one decoder layer: the exporter traces it too, built from the target's faces
(`Faces`: its linears, MoE and attention over the cache in the stored format) where the
reference uses float32 ones. `Block.forward` has no data-dependent Python control flow.
Shapes: b batch, s new positions, t all key positions (cached + new), h heads, c latent,
r rope, d head dim, e experts, k chosen experts, m hidden, f expert width.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..core.config import ModelConfig
from ..plugins.routing import route
from .rope import Rope


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()  # the form ONNX Runtime fuses


def linear(in_features: int, out_features: int) -> nn.Module:
    return nn.Linear(in_features, out_features, bias=False)


def attention_over_cache(absorb: bool):
    """The reference's attention: past = (latent [b, t0, c], rope [b, t0, r]) in float32, joined with the new
    entries new = (latent [b, s, c], rope [b, s, r]) as `as_computed` stores them (float32); absorb=False decompresses per-head keys and values from the latent (the naive form), absorb=True
    folds W_UK into the query and W_UV into the output and attends over the latent."""

    def attend(mla: MLA, q_nope, q_pe, new, past, mask) -> torch.Tensor:
        (past_latent, past_rope), (new_latent, new_rope) = past, new
        latent = torch.cat([past_latent, new_latent], dim=1)  # [b, t, c]
        rope = torch.cat([past_rope, new_rope], dim=1)  # [b, t, r]
        w_kv = mla.kv_b_proj.weight.view(mla.heads, mla.nope + mla.v_dim, mla.latent_dim)
        w_uk, w_uv = w_kv.split([mla.nope, mla.v_dim], dim=1)  # [h, d, c] each
        rope_scores = torch.einsum("bshr,btr->bsht", q_pe, rope)
        if absorb:
            q_latent = torch.einsum("bshd,hdc->bshc", q_nope, w_uk)
            scores = torch.einsum("bshc,btc->bsht", q_latent, latent) + rope_scores
        else:
            k_nope = torch.einsum("btc,hdc->bthd", latent, w_uk)
            scores = torch.einsum("bshd,bthd->bsht", q_nope, k_nope) + rope_scores
        scores = scores * mla.softmax_scale
        scores = scores.masked_fill(~mask[:, :, None, :], float("-inf"))
        probs = scores.softmax(dim=-1)
        if absorb:
            out_latent = torch.einsum("bsht,btc->bshc", probs, latent)
            return torch.einsum("bshc,hdc->bshd", out_latent, w_uv)
        values = torch.einsum("btc,hdc->bthd", latent, w_uv)
        return torch.einsum("bsht,bthd->bshd", probs, values)

    return attend


class MLA(nn.Module):
    """Multi-head latent attention. The cache holds c_kv [c] (normalised) and k_pe [r] (roped) per token;
    how attention reads it is the faces' `attention`."""

    def __init__(self, config: ModelConfig, faces: Faces):
        super().__init__()
        c = config
        self.heads, self.nope, self.rope_dim, self.v_dim = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        self.latent_dim = c.kv_lora_rank
        self.softmax_scale = c.softmax_scale
        self.attention, self.store = faces.attention, faces.store
        make_linear = faces.linear
        if c.q_lora_rank is None:
            self.q_proj = make_linear(c.hidden_size, self.heads * c.qk_head_dim)
        else:
            self.q_a_proj = make_linear(c.hidden_size, c.q_lora_rank)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, c.rms_norm_eps, faces.norm_dtype)
            self.q_b_proj = make_linear(c.q_lora_rank, self.heads * c.qk_head_dim)
        self.kv_a_proj_with_mqa = make_linear(c.hidden_size, c.kv_lora_rank + c.qk_rope_head_dim)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, c.rms_norm_eps, faces.norm_dtype)
        self.kv_b_proj = (faces.kv_b(c) if faces.kv_b is not None
                          else make_linear(c.kv_lora_rank, self.heads * (self.nope + self.v_dim)))
        self.o_proj = make_linear(self.heads * self.v_dim, c.hidden_size)
        self.rotary = Rope(c)

    def project_query(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "q_proj"):
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def project(self, x: torch.Tensor, positions: torch.Tensor):
        """x [b, s, m], positions [b, s] -> q_nope [b, s, h, d], q_pe [b, s, h, r] (roped),
        new_latent [b, s, c] (normalised), new_rope [b, s, r] (roped): what the cache stores."""
        b, s, _ = x.shape
        q = self.project_query(x).view(b, s, self.heads, self.nope + self.rope_dim)
        q_nope, q_pe = q[..., :self.nope], q[..., self.nope:]
        kv = self.kv_a_proj_with_mqa(x)
        new_latent, new_rope = kv[..., :self.latent_dim], kv[..., self.latent_dim:]
        return q_nope, self.rotary(q_pe, positions), self.kv_a_layernorm(new_latent), self.rotary(new_rope, positions)

    def forward(self, x, positions, past, mask):
        """x [b, s, m], positions [b, s], past (the cache's first t0 entries, as the faces' attention reads them),
        mask [b, s, t0 + s] (True: may attend) -> out [b, s, m] and the s new entries as the faces' `store` makes
        them. The chunk's own entries are attended as stored: the attention reads exactly what a later forward
        reads back from the cache, so a text's outputs do not depend on how it was chunked."""
        b, s, _ = x.shape
        q_nope, q_pe, new_latent, new_rope = self.project(x, positions)
        new = self.store(new_latent, new_rope)
        out = self.attention(self, q_nope, q_pe, new, past, mask)  # [b, s, h, v]
        return self.o_proj(out.reshape(b, s, self.heads * self.v_dim)), *new


class MLP(nn.Module):
    """SwiGLU: the dense layers' MLP and the shared expert."""

    def __init__(self, hidden: int, width: int, make_linear=linear):
        super().__init__()
        self.gate_proj = make_linear(hidden, width)
        self.up_proj = make_linear(hidden, width)
        self.down_proj = make_linear(width, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Gate(nn.Module):
    """Sigmoid routing with an auxiliary-loss-free correction bias (noaux_tc).

    The bias only chooses experts; the weights come from the unbiased scores.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        c = config
        self.weight = nn.Parameter(torch.zeros(c.n_routed_experts, c.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(c.n_routed_experts))
        self.top_k, self.n_group, self.topk_group = c.num_experts_per_tok, c.n_group, c.topk_group
        self.normalise, self.scaling = c.norm_topk_prob, c.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [n, m] -> route_weights [n, k], expert_ids [n, k]."""
        return route(x, self.weight, self.e_score_correction_bias, self.top_k, self.n_group, self.topk_group,
                     self.normalise, self.scaling)


class MoE(nn.Module):
    """Routed experts (stacked [e, ...]) plus the shared expert.

    The reference runs every expert on every token and weighs the outputs by the dense
    routing matrix: simple and exportable, though its cost follows e, not k.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        c = config
        e, f, m = c.n_routed_experts, c.moe_intermediate_size, c.hidden_size
        self.gate = Gate(c)
        self.experts_gate_proj = nn.Parameter(torch.zeros(e, f, m))
        self.experts_up_proj = nn.Parameter(torch.zeros(e, f, m))
        self.experts_down_proj = nn.Parameter(torch.zeros(e, m, f))
        self.shared_experts = MLP(m, f * c.n_shared_experts) if c.n_shared_experts else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [n, m]
        route_weights, expert_ids = self.gate(x)
        combine = torch.zeros(x.shape[0], self.experts_gate_proj.shape[0], dtype=x.dtype).scatter(1, expert_ids, route_weights)
        hidden = F.silu(torch.einsum("nm,efm->nef", x, self.experts_gate_proj)) * torch.einsum("nm,efm->nef", x, self.experts_up_proj)
        routed = torch.einsum("ne,nef,emf->nm", combine, hidden, self.experts_down_proj)
        if self.shared_experts is not None:
            routed = routed + self.shared_experts(x)
        return routed.view(shape)


def as_computed(new_latent: torch.Tensor, new_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's store: the cache holds the new entries in float32, as computed."""
    return new_latent, new_rope


@dataclass(frozen=True)
class Faces:
    """What a decoder layer is made of; the dataflow is `Block`'s alone. The reference's faces are float32
    `nn.Linear`s, the dense-routing `MoE` and `attention_over_cache`; the exporter supplies the target's
    lowered modules and the attention op of the cache format (export/graph_modules.py).

    linear(in, out): a projection; kv_b(config): kv_b_proj in the form `attention` reads (None: a linear);
    moe(config): a MoE layer's mlp; store(new_latent [b, s, c], new_rope [b, s, r]) -> the new entries as the
    cache holds them (a tuple: the layer's new cache outputs); attention(mla, q_nope [b, s, h, d], q_pe
    [b, s, h, r], new (store's tuple), past, mask [b, s, t0 + s]) -> [b, s, h, v], over the cache's past entries
    in whatever form `past` holds them and the chunk's own entries as stored, read back as the past is;
    norm_dtype: the RMSNorm weights' dtype."""

    attention: Callable
    linear: Callable[[int, int], nn.Module] = linear
    kv_b: Callable[[ModelConfig], nn.Module] | None = None
    moe: Callable[[ModelConfig], nn.Module] = MoE
    norm_dtype: torch.dtype = torch.float32
    store: Callable[[torch.Tensor, torch.Tensor], tuple] = as_computed


def reference_faces(absorb: bool = False) -> Faces:
    return Faces(attention_over_cache(absorb))


class Block(nn.Module):
    """One decoder layer: norm -> attention -> residual -> norm -> MLP or MoE -> residual, of the given faces."""

    def __init__(self, config: ModelConfig, layer: int, faces: Faces):
        super().__init__()
        c = config
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, faces.norm_dtype)
        self.self_attn = MLA(c, faces)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, faces.norm_dtype)
        self.mlp = faces.moe(c) if c.is_moe_layer(layer) else MLP(c.hidden_size, c.intermediate_size, faces.linear)

    def forward(self, x, positions, past, mask):
        """x [b, s, m] -> x [b, s, m] and the new entries as stored (see MLA.forward): for the reference,
        new_latent [b, s, c], new_rope [b, s, r] in float32."""
        attended, *new = self.self_attn(self.input_layernorm(x), positions, past, mask)
        x = x + attended
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, *new


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig, absorb: bool = False):
        super().__init__()
        c = config
        self.config = c
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(Block(c, i, reference_faces(absorb)) for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = linear(c.hidden_size, c.vocab_size)
