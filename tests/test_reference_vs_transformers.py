"""The eager reference (k2deploy.export) against Hugging Face transformers' DeepseekV3ForCausalLM,
an independent implementation of the same maths, both in float32 with the same dequantised weights.

Measured on CPU (torch 2.13, transformers 5.24), max |logit difference| with logits of magnitude ~13:
  12-token prompt, tiny preset (YaRN factor 32, original_max_position_embeddings 128): 1.1e-5
  160-token prompt, same checkpoint (positions past the YaRN original length):         9.5e-6
  n_group=2, topk_group=1 (grouped noaux_tc routing), 12 / 160 tokens:                   7.2e-6 / 9.5e-6
  rope_scaling=None (plain RoPE, no YaRN mscale), 12 / 160 tokens:                       6.2e-6 / 8.6e-6
For scale: turning transformers' rope_interleave off, or its YaRN off, moves the logits by 5-7.
"""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from k2deploy.core.checkpoint.presets import preset_config  # noqa: E402
from k2deploy.core.checkpoint.reader import Checkpoint  # noqa: E402
from k2deploy.core.checkpoint.synthetic import write_checkpoint  # noqa: E402
from k2deploy.export.reference import prompt_logits  # noqa: E402
from k2deploy.export.weights import load_transformer  # noqa: E402

from k2deploy.export.hf_deepseek import build_hf_model  # noqa: E402

TOLERANCE = 1e-3
SHORT, LONG = 12, 160  # LONG > the tiny preset's YaRN original_max_position_embeddings (128)


def _models(path, config):
    checkpoint = Checkpoint.open(write_checkpoint(path, config, seed=0, shard_bytes=1 << 20))
    return load_transformer(checkpoint, absorb=False), build_hf_model(checkpoint)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return _models(tmp_path_factory.mktemp("hf") / "tiny", preset_config("tiny"))


@pytest.fixture(scope="module")
def grouped(tmp_path_factory):
    # Same tensor names and seed as `tiny`, so the same weights: only the routing differs.
    config = preset_config("tiny", overrides=["n_group=2", "topk_group=1"])
    return _models(tmp_path_factory.mktemp("hf") / "grouped", config)


@pytest.fixture(scope="module")
def plain_rope(tmp_path_factory):
    return _models(tmp_path_factory.mktemp("hf") / "plain", preset_config("tiny").replace(rope_scaling=None))


def _prompt(length: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(length)).tolist()


def _compare(models, length: int) -> float:
    reference, hf = models
    prompt = _prompt(length, reference.config.vocab_size)
    ours = prompt_logits(reference, prompt)
    with torch.no_grad():
        theirs = hf(torch.tensor([prompt]), use_cache=False).logits[0]
    assert ours.shape == theirs.shape == (length, reference.config.vocab_size)
    difference = (ours - theirs).abs().max().item()
    assert difference < TOLERANCE, f"max |logit difference| {difference:.3g} at {length} tokens"
    mismatched = (ours.argmax(-1) != theirs.argmax(-1)).nonzero().flatten().tolist()
    assert not mismatched, f"argmax differs at positions {mismatched}"
    return difference


def test_short_prompt(tiny):
    _compare(tiny, SHORT)  # measured 1.1e-5


def test_prompt_past_yarn_original_length(tiny):
    reference, hf = tiny
    original = reference.config.rope_scaling["original_max_position_embeddings"]
    assert LONG > original
    # The same YaRN frequencies, cos/sin scale and softmax scale on both sides ...
    ours = reference.layers[0].self_attn
    torch.testing.assert_close(ours.rotary.frequencies, hf.model.rotary_emb.inv_freq, rtol=1e-6, atol=0)
    assert ours.rotary.scale == pytest.approx(hf.model.rotary_emb.attention_scaling, rel=1e-12)
    assert ours.softmax_scale == pytest.approx(hf.model.layers[0].self_attn.scaling, rel=1e-12)
    # ... and interpolated ones among them, so positions past `original` run on stretched dims.
    unscaled = 1.0 / reference.config.rope_theta ** (torch.arange(0, ours.rope_dim, 2, dtype=torch.float64) / ours.rope_dim)
    assert (ours.rotary.frequencies.double() < unscaled * 0.5).any()
    _compare(tiny, LONG)  # measured 9.5e-6


@pytest.mark.parametrize("length", [SHORT, LONG])
def test_grouped_routing(grouped, tiny, length):
    # transformers 5.24's DeepseekV3TopkRouter masks the experts of unchosen groups with -inf,
    # as ours does (older DeepSeek remote code used 0.0, which differs when biased scores are
    # negative); so the two must agree here.
    _compare(grouped, length)  # measured 7.2e-6 (12 tokens), 9.5e-6 (160 tokens)
    # The grouping is not a no-op: the same weights routed without groups give other logits.
    prompt = _prompt(length, tiny[0].config.vocab_size)
    assert (prompt_logits(grouped[0], prompt) - prompt_logits(tiny[0], prompt)).abs().max().item() > 0.1


@pytest.mark.parametrize("length", [SHORT, LONG])
def test_plain_rope(plain_rope, length):
    _compare(plain_rope, length)  # measured 6.2e-6 (12 tokens), 8.6e-6 (160 tokens)
