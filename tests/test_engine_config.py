"""The engine's one configuration (runtime/engine/config.py): serve, generate and bench resolve the same one from the
same artifact and options, a bad sizing is one line, and a server's default page pool keeps to the memory left."""

from __future__ import annotations

import pytest

from k2deploy.bench.run import BenchOptions, run_bench
from k2deploy.commands.cli import main
from k2deploy.core.errors import K2Error
from k2deploy.runtime import loading
from k2deploy.runtime.engine.config import EngineConfig

RUNTIME = ["--threads", "2", "--decode", "onnx", "--speculative", "off"]


class Loaded(Exception):
    """Raised where the command would load its model: carries the configuration it was given."""


@pytest.fixture
def resolved(monkeypatch):
    """What each command hands load_backend, which stops it there."""
    def load_backend(manifest, config):
        raise Loaded(config)

    monkeypatch.setattr(loading, "load_backend", load_backend)
    monkeypatch.delenv("K2DEPLOY_API_KEY", raising=False)

    def config_of(run) -> EngineConfig:
        with pytest.raises(Loaded) as loaded:
            run()
        return loaded.value.args[0]

    return config_of


def test_serve_generate_and_bench_get_the_same_engine_from_the_same_options(tiny_cpu_artifact, resolved):
    art = str(tiny_cpu_artifact)
    serve = resolved(lambda: main(["serve", art, "--port", "0", "--max-batch", "4", "--max-context", "40", *RUNTIME]))
    bench = resolved(lambda: run_bench(BenchOptions(art, batches=[1, 4], prompt_lens=[16, 32], gen_len=8, threads=2,
                                                    decode="onnx", speculative="off", baseline="none")))
    generate = resolved(lambda: main(["generate", art, "--prompt-ids", ",".join(["5"] * 32), "--max-new-tokens", "8",
                                      *RUNTIME]))
    for config in (serve, bench, generate):
        assert (config.backend, config.provider, config.threads, config.decode, config.speculative) == \
            ("onnxruntime", "cpu", 2, "onnx", "off")
    assert (serve.max_batch, serve.context, serve.cache_tokens_at_most) == (4, 40, 160)
    assert (bench.max_batch, bench.context, bench.cache_tokens_at_most) == (4, 40, 160)  # its largest cell
    assert (generate.max_batch, generate.cache_tokens_at_most) == (1, 40)  # its one request
    assert serve.cache_token_bytes == bench.cache_token_bytes == generate.cache_token_bytes


def test_a_context_past_the_model_is_one_line_before_loading(tiny_cpu_artifact, resolved, capsys):
    assert main(["serve", str(tiny_cpu_artifact), "--port", "0", "--max-context", "999999"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "k2deploy serve: error: --max-context 999999 is past the model's 4096 positions; give at most 4096"]


def test_the_default_pool_takes_half_the_memory_left_within_the_batch_and_a_page_at_least():
    config = EngineConfig(context=1024, cache_token_bytes=1000, max_batch=8)
    assert config.pool_tokens(available=10**12) == 8 * 1024  # memory to spare: every slot at full context
    assert config.pool_tokens(available=2_000_000) == 1000  # half of what is left
    assert config.pool_tokens(available=100_000) == 64  # one page, whatever is left


def test_a_pool_past_the_memory_left_says_what_would_fit():
    with pytest.raises(K2Error, match=r"^--max-total-tokens 5000 needs 0\.0 GiB of cache, this host has 0\.0 GiB "
                                      r"available; ask for 4000 tokens or fewer$"):
        EngineConfig(context=1024, cache_token_bytes=1000, cache_tokens=5000).pool_tokens(available=4_000_000)
    with pytest.raises(K2Error, match="ask for 50 tokens or fewer"):  # a page is more than there is
        EngineConfig(context=1024, cache_token_bytes=1000).pool_tokens(available=50_000)
