"""The server's Prometheus metrics, in a registry of its own (GET /metrics renders it)."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("k2deploy_requests", "HTTP requests answered, by route and status",
                                ["route", "status"], registry=r)
        self.finished = Counter("k2deploy_generations_finished", "Generations ended, by reason "
                                "(stop, length, cancelled, error)", ["reason"], registry=r)
        self.prompt_tokens = Counter("k2deploy_prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.generated_tokens = Counter("k2deploy_generated_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("k2deploy_time_to_first_token_seconds", "From arrival (queueing included) to the "
                              "first token", buckets=TTFT_BUCKETS, registry=r)
        self.per_token = Histogram("k2deploy_time_per_output_token_seconds", "Between consecutive tokens of a "
                                   "request", buckets=TOKEN_BUCKETS, registry=r)
        self.draft_tokens = Counter("k2deploy_draft_tokens", "Tokens drafted for speculative decoding", registry=r)
        self.accepted_tokens = Counter("k2deploy_draft_tokens_accepted", "Drafted tokens the model's own choice "
                                       "confirmed", registry=r)
        self.decode_batch = Histogram("k2deploy_decode_step_sequences", "Sequences one decode step ran at once",
                                      buckets=BATCH_BUCKETS, registry=r)
        self.queue_depth = Gauge("k2deploy_queue_depth", "Requests waiting for a cache slot", registry=r)
        self.slots = Gauge("k2deploy_cache_slots", "Cache slots (--max-batch)", registry=r)
        self.slots_used = Gauge("k2deploy_cache_slots_used", "Cache slots held by running requests (one each)",
                                registry=r)
        self.cache_tokens = Gauge("k2deploy_cache_tokens", "Token positions the cache's page pool holds "
                                  "(--max-total-tokens)", registry=r)
        self.cache_tokens_used = Gauge("k2deploy_cache_tokens_used", "Token positions filled in held slots",
                                       registry=r)
        self.pages = Gauge("k2deploy_cache_pages", "Pages of the cache's pool", registry=r)
        self.pages_used = Gauge("k2deploy_cache_pages_used", "Pages some running request holds", registry=r)
        self.pages_free = Gauge("k2deploy_cache_pages_free", "Pages a request can take (free, or cached and "
                                "held by none)", registry=r)
        self.pages_cached = Gauge("k2deploy_cache_pages_cached", "Pages findable by their prefix", registry=r)
        self.cached_prompt_tokens = Counter("k2deploy_prompt_tokens_cached", "Prompt tokens served from the "
                                            "prefix cache (not prefilled)", registry=r)
        self.preemptions = Counter("k2deploy_preemptions", "Requests preempted when the cache's pool ran out "
                                   "(run again later; nothing lost)", registry=r)
        self.cache_bytes = Gauge("k2deploy_cache_bytes", "Bytes allocated for the latent cache", registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
