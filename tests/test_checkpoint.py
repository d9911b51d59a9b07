import json
import os

import ml_dtypes
import numpy as np
import pytest

from k2deploy.core.checkpoint import layout
from k2deploy.core.checkpoint.fp8 import dequantize
from k2deploy.core.checkpoint.reader import INDEX_FILE, Checkpoint
from k2deploy.core.errors import K2Error
from k2deploy.core.sizes import count_parameters

E4M3 = ml_dtypes.float8_e4m3fn


def _by_formula(q: np.ndarray, s: np.ndarray) -> np.ndarray:
    """W[i, j] = q[i, j] * s[i // 128, j // 128], element by element, as KIMI_K2.md writes it."""
    out = np.empty(q.shape, np.float32)
    for i in range(q.shape[0]):
        for j in range(q.shape[1]):
            out[i, j] = np.float32(q[i, j].astype(np.float32)) * s[i // 128, j // 128]
    return out


@pytest.mark.parametrize("shape", [(256, 128), (200, 300), (5, 7)])
def test_dequantize_is_the_formula_bit_for_bit(shape):
    rng = np.random.default_rng(1)
    codes = rng.integers(0, 256, size=shape, dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0  # drop the NaN codes
    q = codes.view(E4M3)
    s = rng.uniform(1e-4, 1e-2, size=(-(-shape[0] // 128), -(-shape[1] // 128))).astype(np.float32)
    got = dequantize(q, s, (128, 128))
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got.view(np.uint32), _by_formula(q, s).view(np.uint32))


def test_dequantize_rejects_a_scale_of_the_wrong_shape():
    with pytest.raises(K2Error, match="scale shape"):
        dequantize(np.zeros((200, 300), E4M3), np.ones((1, 3), np.float32), (128, 128))


def test_synthetic_checkpoint_has_the_kimi_layout(tiny_checkpoint):
    checkpoint = Checkpoint.open(tiny_checkpoint)
    index = json.loads((tiny_checkpoint / INDEX_FILE).read_text())
    assert len(set(index["weight_map"].values())) >= 3  # really sharded
    assert index["metadata"]["total_size"] == sum(e.nbytes for e in checkpoint.entries.values())
    entries = checkpoint.entries
    kv_a = entries["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"]
    assert kv_a.dtype == "F8_E4M3"
    assert entries["model.layers.1.self_attn.kv_a_proj_with_mqa.weight_scale_inv"].dtype == "F32"
    assert entries["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == "F32"
    assert entries["model.layers.1.mlp.gate.weight"].dtype == "BF16"
    assert entries["model.embed_tokens.weight"].dtype == "BF16"
    assert "model.layers.0.mlp.gate_proj.weight" in entries and "model.layers.0.mlp.gate.weight" not in entries
    assert np.abs(checkpoint.raw("model.layers.1.mlp.gate.e_score_correction_bias")).max() > 0
    # the router chooses among all experts: scales differ block by block
    scales = checkpoint.raw("model.layers.0.mlp.gate_proj.weight_scale_inv")
    assert scales.shape == (3, 2) and len(np.unique(scales)) == scales.size


def test_official_safetensors_reads_our_shards(tiny_checkpoint):
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file

    checkpoint = Checkpoint.open(tiny_checkpoint)
    for shard in checkpoint.shards():
        for name, tensor in load_file(shard).items():
            ours = checkpoint.raw(name)
            assert tuple(tensor.shape) == ours.shape
            assert tensor.view(torch.uint8).numpy().tobytes() == ours.tobytes()
    assert load_file(checkpoint.shards()[0])["model.embed_tokens.weight"].dtype == torch.bfloat16


def test_same_seed_same_bytes_other_seed_other_bytes(tiny_checkpoint, tmp_path):
    from k2deploy.core.checkpoint.presets import preset_config
    from k2deploy.core.checkpoint.synthetic import write_checkpoint

    config = preset_config("tiny")
    again = Checkpoint.open(write_checkpoint(tmp_path / "a", config, seed=0, shard_bytes=1 << 30))
    other = Checkpoint.open(write_checkpoint(tmp_path / "b", config, seed=1, shard_bytes=1 << 30))
    original = Checkpoint.open(tiny_checkpoint)
    name = "model.layers.2.mlp.experts.3.up_proj.weight"
    assert again.raw(name).tobytes() == original.raw(name).tobytes()  # sharding does not change the bytes
    assert other.raw(name).tobytes() != original.raw(name).tobytes()


def test_reading_a_layer_touches_only_that_layer(tiny_checkpoint):
    checkpoint = Checkpoint.open(tiny_checkpoint)
    assert checkpoint.bytes_read == 0  # opening reads headers only
    for name in checkpoint.layer_names(1):
        checkpoint.raw(name)
    assert checkpoint.bytes_read == checkpoint.layer_bytes(1)
    assert checkpoint.layer_bytes(1) < sum(e.nbytes for e in checkpoint.entries.values()) / 2


def test_parameter_count_from_headers_equals_the_formula(tiny_checkpoint):
    from k2deploy.core.inspect_checkpoint import describe_checkpoint

    checkpoint = Checkpoint.open(tiny_checkpoint)
    counted = describe_checkpoint(checkpoint)["parameters"]
    formula = count_parameters(checkpoint.config)
    assert counted == {"total": formula.total, "active_per_token": formula.active_per_token}
    assert formula.total == sum(s.numel for s in layout.all_tensors(checkpoint.config) if s.role != "scale")


@pytest.mark.parametrize("preset, weights, extra_ignore", [
    ("tiny", "fp8", []), ("small", "fp8", []), ("tiny", "int4", []),
    ("tiny", "int4", [r"re:model\.layers\.2\.mlp\.experts\.3\."]),  # one expert of one layer left BF16
])
def test_checkpoint_bytes_from_the_config_are_those_of_every_tensor(preset, weights, extra_ignore):
    from k2deploy.core.checkpoint.presets import preset_config
    from k2deploy.core.checkpoint.safetensors_io import NUMPY_DTYPES
    from k2deploy.core.checkpoint.synthetic import checkpoint_bytes
    from k2deploy.core.config import ModelConfig

    raw = preset_config(preset, weights=weights).to_dict()
    if extra_ignore:
        raw["quantization_config"]["ignore"] += extra_ignore
    config = ModelConfig.from_dict(raw)
    listed = sum(s.numel * NUMPY_DTYPES[s.dtype].itemsize for s in layout.all_tensors(config))
    assert checkpoint_bytes(config) == listed


def test_kimi_k2_formula_matches_the_published_figures():
    from k2deploy.core.checkpoint.presets import preset_config
    from k2deploy.core.sizes import kv_cache_bytes_per_token

    config = preset_config("k2")
    counts = count_parameters(config)
    assert round(counts.total / 1e9, 1) == 1026.4  # KIMI_K2.md, computed from the config
    assert round(counts.active_per_token / 1e9, 2) == 32.86
    assert kv_cache_bytes_per_token(config) == {"bf16_decompressed": 40960, "bf16_latent": 1152, "fp8_latent": 656,
                                                "int8_latent": 644}


def test_cache_sizes_are_the_layout_the_graphs_hold():
    """A latent of 192 is scaled in three groups of 64 (gcd with 128), as the exported graphs store it: 332 bytes."""
    from k2deploy.core.cache_format import CacheFormat
    from k2deploy.core.checkpoint.presets import preset_config
    from k2deploy.core.sizes import kv_cache_bytes_per_token

    config = preset_config("tiny", overrides=["kv_lora_rank=192"])
    fmt = CacheFormat.for_config(config, "fp8")
    assert (fmt.scale_group, fmt.scales_per_token) == (64, 3)
    assert kv_cache_bytes_per_token(config)["fp8_latent"] == 192 + 3 * 4 + 2 * 16 == fmt.description()[
        "bytes_per_token_per_layer"]
    assert CacheFormat.from_manifest(fmt.description()) == fmt


# -- damaged checkpoints: each names what is wrong -----------------------------------------

def _shard_of(directory, name):
    return json.loads((directory / INDEX_FILE).read_text())["weight_map"][name]


def test_missing_shard(tiny_copy):
    shard = _shard_of(tiny_copy, "model.layers.1.self_attn.o_proj.weight")
    os.remove(tiny_copy / shard)
    with pytest.raises(K2Error, match=f"shard {shard} is missing"):
        Checkpoint.open(tiny_copy)


def test_truncated_shard(tiny_copy):
    shard = tiny_copy / _shard_of(tiny_copy, "model.layers.1.self_attn.o_proj.weight")
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 10)
    with pytest.raises(K2Error, match=f"shard {shard.name} is truncated: tensor model"):
        Checkpoint.open(tiny_copy)


def test_tensor_with_the_wrong_shape(tiny_copy):
    config = json.loads((tiny_copy / "config.json").read_text())
    config["kv_lora_rank"] = 48
    (tiny_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(K2Error, match=r"kv_a_proj_with_mqa.weight in model-\d+-of-\d+.safetensors has shape"):
        Checkpoint.open(tiny_copy)


def test_tensor_missing_from_every_shard(tiny_copy):
    config = json.loads((tiny_copy / "config.json").read_text())
    config["num_hidden_layers"] = 4
    (tiny_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(K2Error, match="tensor model.layers.3.input_layernorm.weight is missing"):
        Checkpoint.open(tiny_copy)


def test_not_a_directory(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(K2Error, match="not a directory"):
        Checkpoint.open(tmp_path / "file")
    with pytest.raises(K2Error, match="no such directory"):
        Checkpoint.open(tmp_path / "absent")
