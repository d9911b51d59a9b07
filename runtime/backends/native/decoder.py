"""The native step: each sequence's next token, or a prompt's tokens, through runtime/backends/native/decode_step.c.

A decode step is a chain of matrix-vector products over small matrices: ONNX Runtime spends more time between
and around them than in them, and does not split them over threads well (docs/performance.md "Threads"). The native step runs
the same maths over the artifact's own weights (its .data files' codes and scales, nothing re-quantised, every
matrix held in the step's tiles by the export: core/native_tiles.py), each product's rows split over a pool of spinning threads, and writes each layer's new latent entry into its page, as
the layer graph's outputs would be stored. A batch of sequences (the server's decode step) takes one step: each
weight row is read once and multiplied by every sequence's input, the routed experts that any sequence chose are
read once for all that chose them, and each sequence's result is the one it gets alone. A prompt is such a batch
too, its tokens at consecutive positions over the same pages (each layer stores every entry before its attention,
which reads positions up to its own), so where the native step runs a model it runs prefill as well and the
layer graphs are never loaded (runtime/backends/onnx/model.py): every token's result is the one it gets alone, whatever
else is in the batch and however its prompt is chunked. Every other artifact runs through the graphs.

What each part follows (the cpu target's graphs; export/graph_modules.py, plugins/int8.py, plugins/mla.py):
linears: MatMulNBits, int8 blocks of the input dim, activations quantised per block (absmax / 127); attention:
MlaAttentionInt8Cache over the int8 cache read in place, W_UK and W_UV int8 per output column (held four input rows
interleaved), the query rows and the probabilities quantised per row as the graph does; routing: MoeRoute (sigmoid,
correction bias, group limit, top-k with ties to the lower id, normalise, scale); experts: QMoE's fused SwiGLU
(gate and up rows interleaved), 8-bit int8 blocks or an INT4 checkpoint's own 4-bit codes (zero point 8, float32
group scales), activations quantised per block or group (ONNX Runtime's QMoE with accuracy_level 4 does the same:
measured equal to 1e-7 with 8 bits, 4e-7 with 4). Layer by layer its output is the graph's to float rounding
(tests/test_native_decode.py); the order of float sums differs, so over many steps an int8 rounding step or a
near-tied expert flips now and then.

The weights are held once: each data file is mapped and the step reads its tiles (and W_UK and W_UV, four rows
interleaved) in place (the page cache's pages are the process's weights; only the norms and the router, widened to
float32, are copies), after one read that hashes each file's chunks on every core against
the manifest (runtime/backends/native/mapped_file.py); ONNX Runtime's sessions are not loaded beside them. With too little
memory for the files, `auto` keeps to the graphs.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import numpy as np

from ....core import native_tiles
from ....core.cache_format import INT8_ZERO_POINT, PAGE_SIZE
from ....core.config import yarn_mscale
from ....core.errors import K2Error
from ....core.host_memory import available_memory
from ....core.manifest import Manifest
from ....core.onnx_wire import external_initializers
from ..onnx.thread_pool import core_cpus
from .build import NativeUnavailable, contract, fields, library
from .core_leases import core_leases
from .mapped_file import MappedFile


_ptr, _int, _float = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
DECODE_KERNELS = ("auto", "native", "onnx")  # --decode: what runs a model on the cpu (runtime/backends/native/choice.py)
STEP_BATCH = 128  # tokens (or head rows) one native call takes at most: bounds its scratch
TYPES = {1: np.float32, 2: np.uint8, 16: np.uint16}  # TensorProto element type -> how its bits are read


class Lin(ctypes.Structure):
    _fields_ = [("w", _ptr), ("s", _ptr), ("n", _int), ("k", _int), ("block", _int), ("bits", _int)]


class Dims(ctypes.Structure):
    _fields_ = [(name, _int) for name in ("hidden", "heads", "nope", "rope", "v", "latent", "q_rank", "vocab", "top_k",
                                          "n_group", "topk_group", "normalise", "max_len")] + \
               [(name, _float) for name in ("eps", "softmax_scale", "rope_scale", "scaling")]


class Layer(ctypes.Structure):
    _fields_ = [("in_norm", _ptr), ("q_norm", _ptr), ("kv_norm", _ptr), ("post_norm", _ptr), ("frequencies", _ptr),
                ("q_a", Lin), ("q_b", Lin), ("kv_a", Lin), ("o", Lin), ("w_uk", _ptr), ("w_uv", _ptr),
                ("uk_s", _ptr), ("uv_s", _ptr), ("moe", _int), ("experts", _int), ("width", _int),
                ("gate", Lin), ("up", Lin), ("down", Lin), ("router", _ptr), ("bias", _ptr), ("fc1", _ptr),
                ("fc2", _ptr), ("fc1_s", _ptr), ("fc2_s", _ptr), ("block", _int), ("bits", _int)]


class Model(ctypes.Structure):
    _fields_ = [("d", Dims), ("layers", _int), ("layer", ctypes.POINTER(Layer)), ("embed", _ptr),
                ("final_norm", _ptr), ("head", Lin)]


class Pages(ctypes.Structure):
    _fields_ = [("latent", _ptr), ("scale", _ptr), ("rope", _ptr)]


MIRRORS = {"K2Lin": Lin, "K2Dims": Dims, "K2Layer": Layer, "K2Model": Model, "K2Pages": Pages}  # C's struct -> ours


def layout_differences(built: dict[str, int]) -> list[str]:
    """Where the library's fields ("K2Layer.w_uk" -> offset, build.fields) and the mirrors' differ, by name."""
    ours = {f"{struct}.{name}": getattr(mirror, name).offset
            for struct, mirror in MIRRORS.items() for name, _ in mirror._fields_}
    return [f"{name} at {built.get(name, 'none')} (here {ours.get(name, 'none')})"
            for name in sorted(set(built) | set(ours)) if built.get(name) != ours.get(name)]


def _address(array: np.ndarray) -> int:
    return array.ctypes.data


class GraphWeights:
    """One graph's external initializers as arrays over its .data file, mapped for the model's life: the int8 and
    4-bit weights are in the native step's tiles in the artifact (core/native_tiles.py), read in place; the few small
    tensors the step takes in another form (norms and router widened to float32) are copies (`held`).
    Its data file is checked by NativeDecoder, all the files in one read into the page cache."""

    def __init__(self, manifest: Manifest, name: str):
        self.manifest = manifest
        self.path = manifest.graph_file(name, hash_data=False)
        self.data_name = manifest.graph_entry(name)["data"]
        self.tensors = external_initializers(self.path)
        self.file = MappedFile(manifest.path(self.data_name))  # graph_file checked every location is this file
        self.held: list[np.ndarray] = []  # arrays made here (widened), kept alive with the model

    def array(self, name: str, shape: tuple[int, ...], types: tuple[int, ...]) -> np.ndarray:
        spec = self.tensors.get(name)
        if spec is None or spec.dims != shape or spec.data_type not in types:
            found = "missing" if spec is None else f"{list(spec.dims)} of type {spec.data_type}"
            raise NativeUnavailable(f"{self.path.name}: {name} is {found}, the native step reads {list(shape)}")
        data = self.file.bytes
        dtype = np.dtype(TYPES[spec.data_type])
        length = int(np.prod(shape)) * dtype.itemsize
        if spec.offset < 0 or spec.length not in (-1, length) or spec.offset + length > len(data):
            raise K2Error(f"{self.path}: {name}'s data ({spec.offset} + {length} bytes) does not fit "
                          f"{spec.location} ({len(data)} bytes); re-export the artifact")
        return data[spec.offset:spec.offset + length].view(dtype).reshape(shape)

    def floats(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """A float32 or bfloat16 tensor as float32, a copy."""
        raw = self.array(name, shape, (1, 16))
        if raw.dtype == np.uint16:
            raw = (raw.astype(np.uint32) << 16).view(np.float32)
        return self.keep(np.array(raw, dtype=np.float32))

    def keep(self, array: np.ndarray) -> np.ndarray:
        self.held.append(array)
        return array

    def tiles(self, codes: str, scales: str, lead: tuple[int, ...], rows: int, width: int,
              bits: int) -> tuple[np.ndarray, np.ndarray, int]:
        """Initializers `codes` and `scales` (their names in rows) in the native step's tiles, in place: `rows` rows of
        `width` inputs, `bits` (8 or 4) a code, a stack of `lead` of them -> (codes, block scales, block)."""
        spec = self.tensors.get(scales + native_tiles.SUFFIX)
        if spec is None:
            held = "in rows, not in the native step's tiles (exported by an older k2deploy); export it again"
            raise NativeUnavailable(f"{self.path.name}: {codes} is " + (held if codes in self.tensors else "missing"))
        blocks = spec.dims[-2] if len(spec.dims) >= 2 else 0
        if not blocks or width % blocks or (width // blocks) % (32 // bits):
            raise NativeUnavailable(f"{self.path.name}: {scales} holds {blocks} blocks a row, which do not split "
                                    f"{width} inputs into blocks of a multiple of {32 // bits}")
        laid = self.array(codes + native_tiles.SUFFIX, native_tiles.codes_shape(lead, rows, width * bits // 8), (2,))
        laid_scales = self.array(scales + native_tiles.SUFFIX, native_tiles.scales_shape(lead, rows, blocks), (1,))
        return laid, laid_scales, width // blocks

    def linear(self, name: str, rows: int, cols: int) -> Lin:
        """`name`.weight_int8 [rows, cols] and its block scales, in tiles (read in place)."""
        codes, scales, block = self.tiles(f"{name}.weight_int8", f"{name}.weight_int8_scale", (), rows, cols, 8)
        return Lin(_address(codes), _address(scales), rows, cols, block, 8)

class NativeDecoder:
    """The whole model's decode step for one or several sequences over one artifact's weights (a cpu-target artifact
    with the int8 cache, int8 linears and 8-bit or 4-bit routed experts); NativeUnavailable where the artifact or host does
    not fit."""

    @staticmethod
    def check_target(manifest: Manifest) -> None:
        """NativeUnavailable unless the artifact is lowered for the cpu target with the int8 cache, its weights in the
        step's tiles."""
        target, cache = manifest.data.get("target"), manifest.kv_cache.get("format")
        if target != "cpu" or cache != "int8":
            raise NativeUnavailable(f"it runs the cpu target with the int8 cache, this artifact is {target} with "
                                    f"{cache}")
        if manifest.data.get("weight_layout") != "native_tiles":
            raise NativeUnavailable("it reads the weights in its tiles, and this artifact holds them in rows (exported "
                                    "by an older k2deploy); export it again to run the native step")

    def __init__(self, manifest: Manifest, threads: int, max_len: int, layers: range | None = None):
        """layers: a pipeline stage's range of decoder layers (default: all), with the embedding where it starts at
        layer 0 and the final norm and head where it ends at the last; only its own files are mapped and checked."""
        self.check_target(manifest)
        c = self.config = manifest.config
        self.layer_range = layers if layers is not None else range(c.num_hidden_layers)
        if self.layer_range.step != 1 or not 0 <= self.layer_range.start < self.layer_range.stop <= c.num_hidden_layers:
            raise K2Error(f"layers {self.layer_range.start}:{self.layer_range.stop} are not a range of the model's "
                          f"{c.num_hidden_layers} decoder layers")
        self.first, self.last = self.layer_range.start == 0, self.layer_range.stop == c.num_hidden_layers
        self.lib = library()
        self.isa = self.lib.k2_isa().decode()  # the instruction-set level its products were built for
        built = contract(self.lib)
        ours = {"page": PAGE_SIZE, "tile": native_tiles.TILE, "code_zero": INT8_ZERO_POINT,
                "sizeof_lin": ctypes.sizeof(Lin), "sizeof_dims": ctypes.sizeof(Dims), "sizeof_layer": ctypes.sizeof(Layer),
                "sizeof_model": ctypes.sizeof(Model), "sizeof_pages": ctypes.sizeof(Pages)}
        differ = [f"{name} {built[name]} (here {value})" for name, value in ours.items() if built[name] != value]
        differ += layout_differences(fields(self.lib))
        if differ:
            raise NativeUnavailable(f"its build does not match this runtime: {', '.join(differ)}; delete "
                                    f"{Path(self.lib._name).parent} to rebuild it")
        limits = {"num_experts_per_tok": built["max_top_k"], "n_group": built["max_groups"],
                  "topk_group": built["max_groups"], "n_routed_experts": built["max_experts"]}
        over = [f"{name} {getattr(c, name)} (at most {most})" for name, most in limits.items() if getattr(c, name) > most]
        if over:
            raise NativeUnavailable(f"its routing takes at most the sizes it was built for: {', '.join(over)}")
        if c.q_lora_rank is None:
            raise NativeUnavailable("it needs q_lora_rank (q_a_proj and q_b_proj)")
        names = [f"layer_{i:03d}" for i in self.layer_range] + (["head"] if self.last else [])
        self.held_bytes = sum(manifest.data["files"][manifest.graph_entry(name)["data"]]["bytes"] for name in names)
        available = available_memory()
        if available is not None and self.held_bytes > available:
            raise NativeUnavailable(f"it maps the layer and head weights ({self.held_bytes / 2**30:.1f} GiB) and "
                                    f"runs on them in memory, and {available / 2**30:.1f} GiB is available")
        self.graphs = [GraphWeights(manifest, name) for name in (["embed"] if self.first else []) + names]  # mapped
        layer_graphs = self.graphs[int(self.first):int(self.first) + len(self.layer_range)]
        self.layers = (Layer * len(self.layer_range))(*(self._layer(i, g) for i, g in zip(self.layer_range, layer_graphs)))
        self.model = Model(self._dims(max_len), len(self.layer_range), self.layers)
        if self.first:  # bfloat16: a step reads one row
            self.model.embed = _address(self.graphs[0].array("weight", (c.vocab_size, c.hidden_size), (16,)))
        if self.last:
            head = self.graphs[-1]
            self.model.final_norm = _address(head.floats("norm.weight", (c.hidden_size,)))
            self.model.head = head.linear("lm_head", c.vocab_size, c.hidden_size)
        # the one read of the data files, into the page cache, checked against the manifest's digests
        manifest.verify([g.data_name for g in self.graphs if g.data_name in manifest.unhashed])
        self.max_len, self.threads_asked, self.batch = max_len, min(threads, built["max_threads"]), 0
        self.scratch = np.zeros(0, np.float32)
        self._room_for(1, NativeUnavailable)
        cpus = self.cpus(self.threads_asked)
        leases = np.array(core_leases(cpus.tolist()), np.int32)  # the host's processes share its cores by them
        self.threads = self.lib.k2_pool_start(self.threads_asked, _address(cpus), _address(leases))  # last: nothing left to refuse
        self._pools: tuple[tuple[int, ...], ctypes.Array] | None = None  # the cache's pools as the step takes them

    def _room_for(self, batch: int, error: type[Exception] = K2Error) -> None:
        """Scratch for a step of `batch` sequences (grown, never shrunk); `error` where it would take over a quarter
        of the available memory."""
        if batch <= self.batch:
            return
        floats = self.lib.k2_scratch_floats(ctypes.addressof(self.model), self.threads_asked, batch)
        available = available_memory()
        if available is not None and floats * 4 > available // 4:
            raise error(f"its scratch for {batch} sequence(s) of up to {self.max_len} positions "
                        f"({floats * 4 / 2**30:.1f} GiB) is over a quarter of the available memory")
        self.scratch, self.batch = np.zeros(floats, np.float32), batch

    def cpus(self, threads: int) -> np.ndarray:
        """Thread t's CPU: the first CPU of each physical core this process may run on, in turn -> int32 [threads];
        -1 for the threads past the cores (a step runs on at most as many threads as there are cores) and
        everywhere where the system cannot pin."""
        cores = core_cpus() if hasattr(os, "sched_setaffinity") else []
        pinned = [core[0] for core in cores[:threads]]
        return np.array(pinned + [-1] * (threads - len(pinned)), np.int32)

    def _dims(self, max_len: int) -> Dims:
        c = self.config
        yarn = c.rope_scaling
        rope_scale = 1.0 if yarn is None else (yarn_mscale(yarn["factor"], yarn.get("mscale", 1))
                                               / yarn_mscale(yarn["factor"], yarn.get("mscale_all_dim", 0)))
        return Dims(c.hidden_size, c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim,
                    c.kv_lora_rank, c.q_lora_rank, c.vocab_size, c.num_experts_per_tok, c.n_group, c.topk_group,
                    int(bool(c.norm_topk_prob)), max_len, c.rms_norm_eps, c.softmax_scale, rope_scale,
                    c.routed_scaling_factor)

    def _layer(self, index: int, g: GraphWeights) -> Layer:
        c = self.config
        m, h, d, r, v, lat = (c.hidden_size, c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim,
                              c.v_head_dim, c.kv_lora_rank)
        attn = "self_attn."
        if d % 4 or lat % 4:
            raise NativeUnavailable(f"it takes W_UK and W_UV four input rows at a time: qk_nope_head_dim {d} and "
                                    f"kv_lora_rank {lat} must be multiples of 4")
        four = native_tiles.FOUR_ROWS  # read in place, four rows interleaved
        w_uk = g.array(f"{attn}kv_b_proj.w_uk_int8{four}", (h, d // 4, lat, 4), (2,))
        w_uv = g.array(f"{attn}kv_b_proj.w_uv_int8{four}", (h, lat // 4, v, 4), (2,))
        layer = Layer(
            in_norm=_address(g.floats("input_layernorm.weight", (m,))),
            q_norm=_address(g.floats(f"{attn}q_a_layernorm.weight", (c.q_lora_rank,))),
            kv_norm=_address(g.floats(f"{attn}kv_a_layernorm.weight", (lat,))),
            post_norm=_address(g.floats("post_attention_layernorm.weight", (m,))),
            frequencies=_address(g.floats(f"{attn}rotary.frequencies", (r // 2,))),
            q_a=g.linear(f"{attn}q_a_proj", c.q_lora_rank, m),
            q_b=g.linear(f"{attn}q_b_proj", h * (d + r), c.q_lora_rank),
            kv_a=g.linear(f"{attn}kv_a_proj_with_mqa", lat + r, m),
            o=g.linear(f"{attn}o_proj", m, h * v),
            w_uk=_address(w_uk), w_uv=_address(w_uv),
            uk_s=_address(g.floats(f"{attn}kv_b_proj.w_uk_scale", (h, 1, lat))),
            uv_s=_address(g.floats(f"{attn}kv_b_proj.w_uv_scale", (h, 1, v))))
        if not c.is_moe_layer(index):
            f = c.intermediate_size
            layer.width = f
            layer.gate, layer.up = g.linear("mlp.gate_proj", f, m), g.linear("mlp.up_proj", f, m)
            layer.down = g.linear("mlp.down_proj", m, f)
            return layer
        e, f = c.n_routed_experts, c.moe_intermediate_size
        layer.moe, layer.experts, layer.width = 1, e, f
        self._experts(g, layer, e, f, m)
        layer.router = _address(g.floats("mlp.gate.weight", (e, m)))
        layer.bias = _address(g.floats("mlp.gate.e_score_correction_bias", (e,)))
        if c.n_shared_experts:
            width = f * c.n_shared_experts
            shared = "mlp.shared_experts."
            layer.gate, layer.up = g.linear(f"{shared}gate_proj", width, m), g.linear(f"{shared}up_proj", width, m)
            layer.down = g.linear(f"{shared}down_proj", m, width)
        return layer

    def layer_step(self, layer: int, hidden: np.ndarray, position: int, page_table: np.ndarray,
                   pools: dict[str, np.ndarray]) -> np.ndarray:
        """One decoder layer for one sequence: hidden [m] in, the layer's output [m] out (a new array); the layer's
        new entry at `position` lands in its page of `pools` (that layer's latent, latent_scale and rope pools,
        [pages, PAGE_SIZE, width])."""
        out = np.array(hidden, dtype=np.float32).reshape(self.config.hidden_size)
        table = np.ascontiguousarray(page_table, dtype=np.int64)
        pages = (Pages * 1)(Pages(_address(pools["latent"]), _address(pools["latent_scale"]), _address(pools["rope"])))
        at = np.array([position], np.int32)  # held while the step reads it
        status = self.lib.k2_decode_layers(ctypes.addressof(self.model), layer, 1, 1, _address(at),
                                           _address(table), len(table), ctypes.addressof(pages), _address(out),
                                           _address(self.scratch))
        if status != 0:
            raise K2Error(f"the native decode step refused layer {layer} at position {position}")
        return out

    @staticmethod
    def _experts(g: GraphWeights, layer: Layer, e: int, f: int, m: int) -> None:
        """The routed experts, fc1 [e, 2f, m] (gate and up rows interleaved) and fc2 [e, m, f], as QMoE holds them,
        in tiles: int8 blocks (bytes code + 128, `experts_fc*_weight`, one float32 scale a block) or an INT4
        checkpoint's own 4-bit codes (zero point 8, two a byte, the lower input in the low nibble,
        `experts_fc*_codes`, one float32 scale a group)."""
        bits = 4 if any(name.startswith("mlp.experts_fc1_codes") for name in g.tensors) else 8
        codes, scales = ("codes", "scales") if bits == 4 else ("weight", "scale")
        fc1, fc1_s, block = g.tiles(f"mlp.experts_fc1_{codes}", f"mlp.experts_fc1_{scales}", (e,), 2 * f, m, bits)
        fc2, fc2_s, down_block = g.tiles(f"mlp.experts_fc2_{codes}", f"mlp.experts_fc2_{scales}", (e,), m, f, bits)
        if down_block != block:
            raise NativeUnavailable(f"{g.path.name}: the experts' blocks differ ({block} and {down_block})")
        layer.block, layer.bits = block, bits
        layer.fc1, layer.fc2, layer.fc1_s, layer.fc2_s = (_address(a) for a in (fc1, fc2, fc1_s, fc2_s))

    def step(self, token: int, position: int, page_table: np.ndarray, arrays: dict[str, np.ndarray]) -> np.ndarray:
        """token at position (the sequence holds `position` entries before it), page_table [n] the sequence's
        pages, arrays the cache's pools by name ([layers, pages, PAGE_SIZE, width]) -> hidden [m], the last layer's
        output; every layer's new entry lands in its page."""
        return self.steps(np.array([token]), np.array([position]), np.asarray(page_table)[None], arrays)[0]

    def steps(self, tokens: np.ndarray, positions: np.ndarray, page_tables: np.ndarray,
              arrays: dict[str, np.ndarray]) -> np.ndarray:
        """One token for each of a batch of sequences: tokens, positions [b], page_tables [b, n] -> hidden [b, m],
        the last layer's of this range (a stage that starts at layer 0). Each weight is read once for the batch;
        each sequence's result is the one it gets alone."""
        c = self.config
        if not self.first:
            raise K2Error(f"layers {self.layer_range.start}:{self.layer_range.stop} take the previous stage's hidden "
                          f"state, not tokens")
        tokens = np.asarray(tokens, dtype=np.int64)
        if tokens.ndim != 1:
            raise K2Error(f"a step takes one token per sequence; got tokens of shape {tokens.shape}")
        bad = (tokens < 0) | (tokens >= c.vocab_size)
        if bad.any():
            raise K2Error(f"token id {int(tokens[bad][0])} is outside the vocabulary (0..{c.vocab_size - 1})")
        positions, tables, pages = self._checked(len(tokens), positions, page_tables, arrays)
        hidden = np.empty((len(tokens), c.hidden_size), np.float32)
        tokens = tokens.astype(np.int32)  # in range: checked above (held here while the step reads it)
        status = self.lib.k2_decode_step(ctypes.addressof(self.model), len(tokens), _address(tokens),
                                         _address(positions), _address(tables), tables.shape[1],
                                         ctypes.addressof(pages), _address(hidden), _address(self.scratch))
        if status != 0:
            raise K2Error(f"the native decode step refused tokens {tokens.tolist()} at positions {positions.tolist()}")
        return hidden

    def layer_steps(self, hidden: np.ndarray, positions: np.ndarray, page_tables: np.ndarray,
                    arrays: dict[str, np.ndarray]) -> np.ndarray:
        """steps() from the previous stage's hidden [b, m] in place of tokens -> this range's hidden [b, m] (a new
        array)."""
        hidden = np.array(hidden, dtype=np.float32, order="C")
        if hidden.ndim != 2 or hidden.shape[1] != self.config.hidden_size:
            raise K2Error(f"a stage's step takes hidden states [batch, {self.config.hidden_size}]; got "
                          f"{list(hidden.shape)}")
        positions, tables, pages = self._checked(len(hidden), positions, page_tables, arrays)
        status = self.lib.k2_decode_layers(ctypes.addressof(self.model), 0, len(self.layer_range), len(hidden),
                                           _address(positions), _address(tables), tables.shape[1],
                                           ctypes.addressof(pages), _address(hidden), _address(self.scratch))
        if status != 0:
            raise K2Error(f"the native decode step refused positions {positions.tolist()}")
        return hidden

    def _checked(self, batch: int, positions: np.ndarray, page_tables: np.ndarray,
                 arrays: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray, ctypes.Array]:
        """A step's positions [batch] and page tables [batch, n] checked against the cache's pools -> (positions
        int32, tables int64, the pools as the step takes them); scratch for the batch."""
        positions = np.asarray(positions, dtype=np.int64)
        tables = np.ascontiguousarray(page_tables, dtype=np.int64)
        if positions.shape != (batch,) or tables.ndim != 2 or len(tables) != batch or not batch:
            raise K2Error(f"a step takes one position and page table per sequence; got {batch} sequences, positions "
                          f"of shape {positions.shape} and page tables of shape {tables.shape}")
        bad = (positions < 0) | (positions >= min(self.max_len, tables.shape[1] * PAGE_SIZE))
        if bad.any():
            raise K2Error(f"position {int(positions[bad][0])} is past the sequence's pages or the model's "
                          f"{self.max_len} positions")
        latent, scale, rope = arrays["latent"], arrays["latent_scale"], arrays["rope"]
        if tables.min() < 0 or tables.max() >= latent.shape[1]:
            raise K2Error("the page table names pages the cache does not hold")
        self._room_for(batch)
        return positions.astype(np.int32), tables, self._layer_pools(latent, scale, rope)  # in range: checked above

    def _layer_pools(self, latent: np.ndarray, scale: np.ndarray, rope: np.ndarray) -> ctypes.Array:
        """Each layer's pools [pages, PAGE_SIZE, width], made once per cache (a step otherwise rebuilds them)."""
        key = (_address(latent), _address(scale), _address(rope), latent.shape[1])
        if self._pools is None or self._pools[0] != key:
            c, layers = self.config, len(self.layer_range)
            pages = latent.shape[1] if latent.ndim == 4 else -1
            expected = {"latent": (latent, (layers, pages, PAGE_SIZE, c.kv_lora_rank), (np.uint8,)),
                        "latent_scale": (scale, (layers, pages, PAGE_SIZE, 1), (np.float32,)),  # one a token
                        "rope": (rope, (layers, pages, PAGE_SIZE, c.qk_rope_head_dim), (np.float16, np.uint16))}
            for name, (array, shape, types) in expected.items():  # the step writes and reads them in place
                if array.shape != shape or array.dtype.type not in types or not array.flags.c_contiguous:
                    raise K2Error(f"the cache's {name} pool is {array.dtype} {list(array.shape)}, the native step "
                                  f"takes {list(shape)}; the artifact's kv_cache does not match its model")
            self._pools = key, (Pages * layers)(*(Pages(_address(latent[i]), _address(scale[i]), _address(rope[i]))
                                                  for i in range(layers)))
        return self._pools[1]

    def logits(self, hidden: np.ndarray, batch: int = STEP_BATCH) -> np.ndarray:
        """hidden [..., m] -> logits [..., vocab] float32: the final norm and the head, `batch` rows a call (each
        weight row read once for them), on a range that ends at the last layer."""
        if not self.last:
            raise K2Error(f"layers {self.layer_range.start}:{self.layer_range.stop} do not end at the head")
        rows = np.ascontiguousarray(hidden, dtype=np.float32).reshape(-1, self.config.hidden_size)
        out = np.empty((len(rows), self.config.vocab_size), np.float32)
        for at in range(0, len(rows), batch):
            part = np.ascontiguousarray(rows[at:at + batch])
            self._room_for(len(part))
            self.lib.k2_logits(ctypes.addressof(self.model), len(part), _address(part), _address(out[at:at + batch]),
                               _address(self.scratch))
        return out.reshape(*np.shape(hidden)[:-1], self.config.vocab_size)
