"""benchmarks/stream_bound.py: the decode step's products it streams, and its native kernel streaming exactly
those bytes at one and two threads (no timing is asserted)."""

import importlib.util
import math
import shutil
from pathlib import Path

import pytest

from k2deploy.core.checkpoint.presets import preset_config

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "stream_bound.py"


def load_script():
    spec = importlib.util.spec_from_file_location("stream_bound", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_step_holds_every_layers_products_and_the_experts_chosen_of_each_moe_layer():
    config = preset_config("small")
    lines = load_script().step_products(config, context=640)
    experts = [line for line in lines if line.startswith("E ")]
    assert len(experts) == config.num_hidden_layers - config.first_k_dense_replace
    f, h = config.moe_intermediate_size, config.hidden_size
    assert experts[0] == f"E {config.n_routed_experts} {config.num_experts_per_tok} {f} {h} {f} {h} {h} {f}"
    assert lines[-1] == f"P {config.vocab_size} {h}"  # the head, last
    assert f"P 640 {config.kv_lora_rank + config.qk_rope_head_dim}" in lines  # the cache each layer reads
    dense = config.intermediate_size
    assert lines[7:10] == [f"P {dense} {h}", f"P {dense} {h}", f"P {h} {dense}"]  # layer 0's MLP after attention


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler on PATH")
@pytest.mark.parametrize("threads", [1, 2])
def test_the_kernel_streams_each_product_once_and_k_of_e_experts_a_step(tmp_path, threads):
    script = load_script()
    products = ["P 32 64", "E 6 2 16 64 16 64 64 16", "P 48 128"]
    result = script.run_kernel(script.compile_kernel(tmp_path), products, threads, steps=5, warmup=1, seed=1)
    expert = 16 * 64 * 3
    assert result["bytes"] == 32 * 64 + 2 * expert + 48 * 128
    assert all(math.isfinite(result[key]) and result[key] >= 0 for key in ("step_ms", "gbps"))  # whatever the speed
