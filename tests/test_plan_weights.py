"""plan --weights: the int8 and int4 formats' bytes by hand on `tiny`, the same bytes as the cpu lowering's buffers,
CPU hosts as devices, and the formats side by side."""

import json

import pytest
from plan_helpers import nbytes, run_plan

from k2deploy.core.checkpoint import layout
from k2deploy.core.checkpoint.presets import preset_config
from k2deploy.core.errors import K2Error
from k2deploy.core.held_weights import ModelBytes
from k2deploy.core.placement import parse_devices
from k2deploy.core.plan import plan


def tiled(rows: int) -> int:
    """Rows in whole tiles of 64, as the cpu target holds them (the rows past the weight's zero)."""
    return -(-rows // 64) * 64


def int8(out_features: int, in_features: int, block: int, rows=tiled) -> int:
    """uint8 codes plus one float32 scale per block along the input dim, of rows(out_features) rows."""
    return rows(out_features) * in_features + rows(out_features) * (in_features // block) * 4


def int4(out_features: int, in_features: int, rows=tiled) -> int:
    """Two 4-bit codes per byte plus one float32 scale (what QMoE takes) per 32 values along the input dim."""
    return rows(out_features) * in_features // 2 + rows(out_features) * (in_features // 32) * 4


def paired(rows: int) -> int:
    """A routed expert's gate or up rows: the two interleaved are one weight of 2 x rows, tiled as one."""
    return tiled(2 * rows) // 2


# tiny: hidden 192, q_lora 96, kv_lora 64, 4 heads of nope 32 + rope 16 and v 32, dense 320, experts 16 x 96 (top-4),
# one shared expert, vocab 1024; every int8 or 4-bit weight's rows in whole tiles of 64. Blocks: the largest of 128, 64, 32, 16 dividing the input dim (192 -> 64,
# 96 -> 32, 128 -> 128, 320 -> 64); the routed experts one block dividing 192 and 96 -> 32.
NORMS = (192 + 96 + 64 + 192) * 2
ATTENTION_INT8 = int8(96, 192, 64) + int8(192, 96, 32) + int8(80, 192, 64) + int8(192, 128, 128)
KV_B_FP8 = 256 * 64 + 2 * 1 * 4  # kv_b_proj [4 x (32 + 32), 64] stays FP8 with its 128x128 block scales
DENSE_INT8 = 2 * int8(320, 192, 64) + int8(192, 320, 64)
ROUTER = 16 * 192 * 2 + 16 * 4
SHARED_INT8 = 2 * int8(96, 192, 64) + int8(192, 96, 32)
EXPERT_INT8 = 2 * int8(96, 192, 32, paired) + int8(192, 96, 32)
EXPERT_INT4 = 2 * int4(96, 192, paired) + int4(192, 96)
EMBEDDING = 1024 * 192 * 2
HEAD_INT8 = 192 * 2 + int8(1024, 192, 64)


@pytest.fixture(scope="module")
def tiny():
    return preset_config("tiny")


def test_int8_bytes_by_hand(tiny):
    held = ModelBytes.of(tiny, "int8", "fp8")
    fixed = NORMS + ATTENTION_INT8 + KV_B_FP8
    assert held.layers[0].total == fixed + DENSE_INT8
    assert (held.layers[1].fixed, held.layers[1].expert, held.layers[1].experts) == (
        fixed + ROUTER + SHARED_INT8, EXPERT_INT8, 16)
    assert held.embedding == EMBEDDING and held.head == HEAD_INT8
    moe = fixed + ROUTER + SHARED_INT8 + 16 * EXPERT_INT8
    assert held.total == EMBEDDING + fixed + DENSE_INT8 + 2 * moe + HEAD_INT8


def test_int4_holds_the_routed_experts_in_groups_of_32_and_the_rest_as_int8(tiny):
    held, as_int8 = ModelBytes.of(tiny, "int4", "fp8"), ModelBytes.of(tiny, "int8", "fp8")
    assert EXPERT_INT4 == (3 * 96 * 192) * (0.5 + 4 / 32)  # 0.625 bytes per value
    assert [layer.expert for layer in held.layers] == [0, EXPERT_INT4, EXPERT_INT4]
    assert [layer.fixed for layer in held.layers] == [layer.fixed for layer in as_int8.layers]
    assert held.total == as_int8.total - 2 * 16 * (EXPERT_INT8 - EXPERT_INT4)


def test_with_the_int8_cache_kv_b_is_held_as_int8_w_uk_and_w_uv(tiny):
    # W_UK [4, 32, 64] and W_UV [4, 64, 32] int8, one float32 scale per output column per head
    absorbed = 4 * (32 * 64 + 64 * 32) + 4 * 4 * (64 + 32)
    held = ModelBytes.of(tiny, "int8", "int8")
    assert held.layers[1].fixed == NORMS + ATTENTION_INT8 + absorbed + ROUTER + SHARED_INT8


def test_stored_is_the_checkpoint(tiny):
    stored = ModelBytes.of(tiny)
    assert stored.total == nbytes(layout.all_tensors(tiny))


@pytest.mark.parametrize("cache_format", ["fp8", "int8"])
def test_int8_bytes_are_the_cpu_lowerings_weights(tiny, cache_format):
    torch = pytest.importorskip("torch")
    from k2deploy.export.graph_modules import ExportHead, ExportLayer

    def weight_bytes(module: torch.nn.Module) -> int:  # its tensors but the graph constants (rope, e4m3 table)
        tensors = [*module.named_buffers(), *module.named_parameters()]
        return sum(t.numel() * t.element_size() for name, t in tensors
                   if not name.endswith(("rotary.frequencies", "e4m3_values")))

    held = ModelBytes.of(tiny, "int8", cache_format)
    assert [layer.total for layer in held.layers] == [weight_bytes(ExportLayer(tiny, i, cache_format, "cpu"))
                                                      for i in range(3)]
    assert held.head == weight_bytes(ExportHead(tiny, "cpu"))


def test_a_cpu_host_gives_its_memory_and_bandwidth_and_defaults_to_int8():
    kind, count = parse_devices("1xCPU:768GB@0.3TB/s")
    assert (kind.memory_bytes, kind.bandwidth_bytes_per_s, kind.cpu, kind.default_weights, count) == (
        768e9, 0.3e12, True, "int8", 1)
    assert parse_devices("1xCPU:1.5TB@400GB/s")[0].memory_bytes == 1.5e12
    assert parse_devices("16xH200")[0].default_weights == "stored"
    for text in ("1xCPU:768GB", "1xCPU", "1xCPU@0.3TB/s"):
        with pytest.raises(K2Error, match="give the CPU host's memory and its memory bandwidth, e.g. "
                                          r"1xCPU:768GB@0\.3TB/s \(plan does not measure them"):
            parse_devices(text)


def test_decode_on_a_cpu_host_reads_the_int4_bytes(tiny):
    info = plan(tiny, "1xCPU:64GB@100GB/s", context=100, batch=1, weights="int4")
    assert info["weights"] == {"format": "int4", "bytes": ModelBytes.of(tiny, "int4", "fp8").total}
    (row,) = info["per_device"]
    assert row["device"] == "cpu" and info["placement"]["text"] == "0:3@cpu"
    fixed = NORMS + ATTENTION_INT8 + KV_B_FP8
    cache = 100 * 3 * info["kv_cache"]["bytes_per_token_per_layer"]
    # batch 1: one embedding row (BF16), every dense byte, 4 of the 16 experts per MoE layer, the whole head
    read = 192 * 2 + fixed + DENSE_INT8 + 2 * (fixed + ROUTER + SHARED_INT8 + 4 * EXPERT_INT4) + HEAD_INT8 + cache
    assert row["decode_read_bytes"] == read
    assert info["decode_ms_per_token"] == pytest.approx(1e3 * read / 100e9)


def test_k2_on_a_768gb_host_fits_only_as_int4_and_says_so():
    with pytest.raises(K2Error, match=r"1\.06 TB .* at least 2 such devices; --weights int4 \(647\.55 GB\) fits$"):
        run_plan("--preset", "k2", "--devices", "1xCPU:768GB@0.3TB/s", "--context", "8192")
    with pytest.raises(K2Error, match="is a GPU, but --devices 1xCPU:768GB@0.3TB/s are CPU hosts"):
        run_plan("--preset", "k2", "--devices", "1xCPU:768GB@0.3TB/s", "--placement", "0:61@cuda:0")


def test_the_formats_side_by_side(capsys):
    run_plan("--preset", "k2", "--devices", "1xCPU:768GB@0.3TB/s", "--context", "8192", "--weights", "int4", "--json")
    info = json.loads(capsys.readouterr().out)
    rows = {r["weights"]: r for r in info["weights_compared"]}
    assert [rows[w]["fits"] for w in ("stored", "int8", "int4")] == [False, False, True]
    assert rows["int4"]["decode_ms_per_token"] == info["decode_ms_per_token"]
    assert rows["int4"]["tokens_per_s"] == info["tokens_per_s_in_turn"]
    assert rows["int8"]["weights_bytes"] == ModelBytes.of(preset_config("k2"), "int8", "fp8").total
    assert "at least 2 such devices" in rows["int8"]["why"]
    run_plan("--preset", "k2", "--devices", "1xCPU:768GB@0.3TB/s", "--context", "8192", "--weights", "int4")
    table = capsys.readouterr().out.splitlines()
    assert table[-1].split() == ["int4", "647.55", "GB", "yes", f"{info['decode_ms_per_token']:.2f}",
                                 f"{info['tokens_per_s_in_turn']:,.0f}"]
    assert table[-2].split()[:5] == ["int8", "1.06", "TB", "no", "-"]
