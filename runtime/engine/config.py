"""The engine's one configuration: how an artifact's model runs (backend, provider, threads, placement, decode
kernels, drafted tokens) and how the step loop over it is sized (requests running and waiting, positions one may
reach, the cache's page pool). `resolve_engine_config` makes it once, from the manifest and a command's options;
serve, generate, score and bench load their model (`runtime/loading.py`) and size their loop from it.

As in nano-vllm, one figure waits for the host: a server's default page pool takes half the memory left once the
weights are in, so the engine asks `EngineConfig.pool_tokens` when it allocates the cache.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...core.cache_format import PAGE_SIZE, CacheFormat
from ...core.errors import K2Error
from ...core.manifest import Manifest

# the options every command that runs an artifact shares (commands/runtime_options.py); one it lacks keeps its default
RUNTIME_OPTIONS = ("backend", "provider", "threads", "placement", "ray", "decode", "speculative")


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs an artifact and how its step loop is sized; made by resolve_engine_config."""

    context: int  # positions one request may reach
    cache_token_bytes: int  # one token's cache over every layer
    max_batch: int = 1  # requests running at once: the cache's slots
    max_queue: int = 0  # requests that may wait for a slot or for pages
    cache_tokens: int | None = None  # the page pool asked for; None: max_batch x context, a server's sized to memory
    prefix_cache: bool = True  # a prompt reuses the cached pages of a prefix an earlier request computed
    speculative: str = "auto"  # drafted tokens checked where they pay, or off (runtime/engine/speculation.py)
    backend: str = "onnxruntime"  # or tensorrt
    provider: str = "cpu"  # ONNX Runtime's execution provider
    threads: int | None = None  # the process's intra-op pool; None: the host's physical cores (a stage's share)
    placement: str | None = None  # pipeline stages: "auto" or layer ranges on devices
    ray: str | None = None  # the stages on Ray actors: "auto" or HOST:PORT
    decode: str = "auto"  # the cpu provider's decode step: native, onnx or auto

    @property
    def cache_tokens_at_most(self) -> int:
        """The tokens the cache may come to hold: what each placed stage is checked against."""
        return self.cache_tokens or self.max_batch * self.context

    def pool_tokens(self, available: int) -> int:
        """The server's page pool in tokens, with `available` bytes left on the host once the weights are in: the
        pool asked for, else half of what is left (at most max_batch x context, at least a page); a K2Error where it
        needs more than is left."""
        tokens = self.cache_tokens or max(PAGE_SIZE, min(self.cache_tokens_at_most,
                                                         available // 2 // self.cache_token_bytes))
        if tokens * self.cache_token_bytes > available:
            raise K2Error(f"--max-total-tokens {tokens} needs {tokens * self.cache_token_bytes / 2**30:.1f} GiB of "
                          f"cache, this host has {available / 2**30:.1f} GiB available; ask for "
                          f"{available // self.cache_token_bytes} tokens or fewer")
        return tokens


def resolve_engine_config(manifest: Manifest, options=None, *, max_batch: int = 1, max_context: int | None = None,
                          cache_tokens: int | None = None, max_queue: int = 0,
                          prefix_cache: bool = True) -> EngineConfig:
    """The engine's configuration for `manifest`'s model. options: what the command was given of RUNTIME_OPTIONS
    (an argparse namespace, bench's options; None: their defaults); max_context: positions one request may reach
    (default and most: the model's); cache_tokens: the page pool (default: max_batch x max_context, a server's
    sized to the memory left)."""
    model_context = manifest.config.max_position_embeddings
    if max_context is not None and max_context > model_context:
        raise K2Error(f"--max-context {max_context} is past the model's {model_context} positions; give at most "
                      f"{model_context}")
    chosen = {name: getattr(options, name) for name in RUNTIME_OPTIONS if hasattr(options, name)}
    per_layer = CacheFormat.for_artifact(manifest.kv_cache, manifest.config, manifest.root).bytes_per_token_per_layer
    return EngineConfig(context=max_context or model_context,
                        cache_token_bytes=per_layer * manifest.config.num_hidden_layers, max_batch=max_batch,
                        max_queue=max_queue, cache_tokens=cache_tokens, prefix_cache=prefix_cache, **chosen)
