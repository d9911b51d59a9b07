import pytest

torch = pytest.importorskip("torch")

from k2deploy.core.checkpoint.reader import Checkpoint  # noqa: E402
from k2deploy.export import reference  # noqa: E402
from k2deploy.export.weights import load_transformer  # noqa: E402

PROMPT = [5, 17, 300, 42, 9, 1000, 77, 3, 640, 12, 12, 401]


@pytest.fixture(scope="module")
def models(tiny_checkpoint):
    checkpoint = Checkpoint.open(tiny_checkpoint)
    return load_transformer(checkpoint, absorb=False), load_transformer(checkpoint, absorb=True)


def test_absorbed_attention_equals_naive(models):
    naive, absorbed = models
    a, b = reference.prompt_logits(naive, PROMPT), reference.prompt_logits(absorbed, PROMPT)
    assert a.abs().max() > 1  # informative logits, not a collapse to zero
    # The same sums in another order: the difference is fp32 rounding, ~1e-5 on logits of size ~10.
    torch.testing.assert_close(a, b, rtol=0, atol=5e-5)


@pytest.mark.parametrize("absorb", [False, True])
def test_decode_with_the_cache_equals_full_recomputation(models, absorb):
    model = models[absorb]
    generated = reference.greedy(model, PROMPT, 12)
    full = reference.prompt_logits(model, PROMPT + generated)
    # Each greedy token is the argmax of the full recomputation at its position ...
    assert full[len(PROMPT) - 1:-1].argmax(-1).tolist() == generated
    # ... and the cached decode produced the same logits.
    cache = reference.LatentCache(model, 1)
    reference.forward(model, torch.tensor([PROMPT]), cache)
    for i, token in enumerate(generated):
        step = reference.forward(model, torch.tensor([[token]]), cache)[0, 0]
        torch.testing.assert_close(step, full[len(PROMPT) + i], rtol=0, atol=5e-5)
    assert len(set(generated)) > 3  # the synthetic weights do not collapse onto one token


def test_routing_uses_the_bias_to_choose_and_the_scores_to_weigh(models):
    gate = models[0].layers[1].mlp.gate
    x = torch.randn(64, gate.weight.shape[1], generator=torch.Generator().manual_seed(0))  # fixed: no ties by chance
    weights, ids = gate(x)
    scores = torch.sigmoid(x @ gate.weight.T)
    assert torch.equal(ids.sort(-1).values, (scores + gate.e_score_correction_bias).topk(gate.top_k).indices.sort(-1).values)
    expected = scores.gather(1, ids)
    expected = expected / expected.sum(-1, keepdim=True) * gate.scaling
    torch.testing.assert_close(weights, expected)
    # the bias overturns the raw top-k for some tokens (what makes it worth testing)
    assert not torch.equal(ids.sort(-1).values, scores.topk(gate.top_k).indices.sort(-1).values)


def test_grouped_routing_only_chooses_from_the_best_groups(tiny_checkpoint):
    from k2deploy.core.checkpoint.presets import preset_config
    from k2deploy.export.model import Gate

    gate = Gate(preset_config("tiny", overrides=["n_group=4", "topk_group=2", "num_experts_per_tok=4"]))
    seeded = torch.Generator().manual_seed(0)  # the same draw every run
    torch.nn.init.normal_(gate.weight, generator=seeded)
    torch.nn.init.normal_(gate.e_score_correction_bias, std=0.2, generator=seeded)
    x = torch.randn(32, gate.weight.shape[1], generator=seeded)
    _, ids = gate(x)
    choice = torch.sigmoid(x @ gate.weight.T) + gate.e_score_correction_bias
    group_scores = choice.view(32, 4, 4).topk(2, dim=-1).values.sum(-1)
    best_groups = group_scores.topk(2, dim=-1).indices
    assert all(set((ids[n] // 4).tolist()) <= set(best_groups[n].tolist()) for n in range(32))
