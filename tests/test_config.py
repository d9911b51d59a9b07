import json

import pytest

from k2deploy.core.checkpoint.presets import KIMI_K2, preset_config
from k2deploy.core.config import ModelConfig
from k2deploy.core.errors import K2Error


def test_reads_the_released_kimi_k2_config():
    config = ModelConfig.from_dict(KIMI_K2)
    assert config.num_hidden_layers == 61 and config.n_routed_experts == 384
    assert config.fp8_block == (128, 128)
    assert [config.is_moe_layer(i) for i in (0, 1, 60)] == [False, True, True]
    # 192 ** -0.5 * mscale ** 2 with mscale = 0.1 * ln(32) + 1 (KIMI_K2.md)
    assert config.softmax_scale == pytest.approx(192 ** -0.5 * (0.1 * 3.4657359 + 1) ** 2, rel=1e-6)
    assert config.to_dict() == dict(sorted(KIMI_K2.items()))  # unknown keys (auto_map, ...) survive


def test_deepseek_v3_model_type_is_accepted():
    assert ModelConfig.from_dict({**KIMI_K2, "model_type": "deepseek_v3"}).model_type == "deepseek_v3"


@pytest.mark.parametrize(
    "change, field",
    [
        ({"model_type": "llama"}, "model_type"),
        ({"num_experts_per_tok": 400}, "num_experts_per_tok"),
        ({"n_group": 5}, "n_group"),
        ({"topk_group": 2}, "topk_group"),
        ({"hidden_size": "7168"}, "hidden_size"),
        ({"first_k_dense_replace": 99}, "first_k_dense_replace"),
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"num_key_value_heads": 8}, "num_key_value_heads"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling"),
        ({"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128]}}, "quantization_config"),
    ],
)
def test_a_bad_field_is_named(change, field):
    with pytest.raises(K2Error, match=field):
        ModelConfig.from_dict({**KIMI_K2, **change})


def test_a_missing_field_is_named():
    raw = dict(KIMI_K2)
    del raw["kv_lora_rank"]
    with pytest.raises(K2Error, match="missing field 'kv_lora_rank'"):
        ModelConfig.from_dict(raw)


def test_from_file_reports_bad_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(K2Error, match="not valid JSON"):
        ModelConfig.from_file(tmp_path / "config.json")


def test_presets_and_overrides():
    tiny = preset_config("tiny")
    assert tiny.hidden_size % 128 != 0  # partial FP8 edge blocks
    assert tiny.q_lora_rank and tiny.first_k_dense_replace == 1 and tiny.rope_scaling["type"] == "yarn"
    changed = preset_config("tiny", layers=5, overrides=["n_routed_experts=32", "rope_scaling.factor=8"])
    assert (changed.num_hidden_layers, changed.n_routed_experts, changed.rope_scaling["factor"]) == (5, 32, 8)
    with pytest.raises(K2Error, match="key=value"):
        preset_config("tiny", overrides=["n_routed_experts"])
    with pytest.raises(K2Error, match="num_experts_per_tok"):
        preset_config("tiny", overrides=["num_experts_per_tok=99"])
    assert json.loads(json.dumps(preset_config("k2").to_dict()))["vocab_size"] == 163840
