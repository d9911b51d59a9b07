"""The result document of `k2deploy bench` (DIR/<device>/bench.json): a versioned JSON Schema.

`schema` names the document, `schema_version` its version: a change that renames, removes or
re-means a field increments it, and `bench compare` refuses versions it does not read. Every
figure measured more than once is a *summary* (median, p10, p90, min, max, mean, n, spread =
(p90 - p10) / median). Times are milliseconds, rates tokens per second, sizes bytes.

The schema is also written next to every result as `schema.json`. `validate(doc)` checks a
document with the `jsonschema` package.
"""

from __future__ import annotations

SCHEMA_NAME = "k2deploy-bench"
SCHEMA_VERSION = 1

_NUMBER_OR_NULL = {"type": ["number", "null"]}
_INT_OR_NULL = {"type": ["integer", "null"]}
_STRING_OR_NULL = {"type": ["string", "null"]}

SUMMARY = {
    "type": "object",
    "description": "A figure measured n times: its median, 10th and 90th percentiles, extremes, mean, and "
                   "spread = (p90 - p10) / median.",
    "required": ["median", "p10", "p90", "min", "max", "mean", "n", "spread"],
    "additionalProperties": False,
    "properties": {
        "median": {"type": "number"},
        "p10": {"type": "number"},
        "p90": {"type": "number"},
        "min": {"type": "number"},
        "max": {"type": "number"},
        "mean": {"type": "number"},
        "n": {"type": "integer", "minimum": 1},
        "spread": {"type": "number", "minimum": 0},
    },
}

SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "$id": f"https://k2deploy/schemas/bench-v{SCHEMA_VERSION}.json",
    "title": "k2deploy bench result",
    "description": __doc__,
    "type": "object",
    "$defs": {
        "summary": SUMMARY,
        "summary_or_null": {"oneOf": [{"$ref": "#/$defs/summary"}, {"type": "null"}]},
        "cell": {
            "type": "object",
            "description": "One (batch, prompt length) cell: `repeats` runs of prefill + first token, then "
                           "gen_len - 1 decode steps.",
            "required": ["batch", "prompt_len", "gen_len", "ttft_ms", "tpot_ms", "prefill_tokens_per_s",
                         "stream_tokens_per_s", "batch_tokens_per_s", "decode_step_ms", "breakdown_sum_ratio",
                         "kv_cache_bytes_allocated", "peak_rss_bytes", "bound", "baseline"],
            "additionalProperties": False,
            "properties": {
                "batch": {"type": "integer", "minimum": 1},
                "prompt_len": {"type": "integer", "minimum": 1},
                "gen_len": {"type": "integer", "minimum": 2, "description": "tokens generated per row per run"},
                "ttft_ms": {"$ref": "#/$defs/summary", "description": "time to first token: prefill of the "
                            "batch and the first sampled token, per run"},
                "tpot_ms": {"$ref": "#/$defs/summary", "description": "time per output token: per run, the "
                            "mean decode step (runtime call to sampled tokens); = decode_step_ms.step"},
                "prefill_tokens_per_s": {"$ref": "#/$defs/summary", "description": "batch x prompt_len / "
                                         "prefill time, per run"},
                "stream_tokens_per_s": {"$ref": "#/$defs/summary", "description": "one sequence's decode "
                                        "rate: steps / decode time, per run"},
                "batch_tokens_per_s": {"$ref": "#/$defs/summary", "description": "all rows' decode rate: "
                                       "batch x steps / decode time, per run"},
                "decode_step_ms": {
                    "type": "object",
                    "description": "one decode step by stage, per run the mean per step: the ONNX Runtime "
                                   "sessions (OrtModel.stage_seconds), sampling, and the overhead between "
                                   "sessions = step - sessions - sampling; step is tpot_ms. Run by run the "
                                   "stages add up to the step exactly; their medians approximately "
                                   "(breakdown_sum_ratio)",
                    "required": ["embed", "layers", "head", "sampling", "overhead", "step"],
                    "additionalProperties": False,
                    "properties": {
                        "embed": {"$ref": "#/$defs/summary"},
                        "layers": {"type": "array", "items": {"$ref": "#/$defs/summary"}},
                        "head": {"$ref": "#/$defs/summary"},
                        "sampling": {"$ref": "#/$defs/summary"},
                        "overhead": {"$ref": "#/$defs/summary"},
                        "step": {"$ref": "#/$defs/summary"},
                        "native_step": {"$ref": "#/$defs/summary", "description": "the native decode step: the "
                                        "embedding and every layer in one call (its layers' own entries are 0)"},
                    },
                },
                "breakdown_sum_ratio": {"type": "number", "description": "sum of the stages' medians / the "
                                        "step's median (tpot)"},
                "kv_cache_bytes_allocated": {"type": "integer", "minimum": 0,
                                             "description": "the latent cache of one run: batch x (prompt_len + "
                                                            "gen_len) positions, every layer"},
                "peak_rss_bytes": {"type": ["integer", "null"], "description": "the process's peak RSS during "
                                   "this cell's runs (arenas ONNX Runtime kept from earlier cells included)"},
                "speculative": {
                    "type": "object",
                    "description": "speculative decoding in this cell's timed runs, summed over their requests "
                                   "(runtime/engine/speculation.py): tokens drafted, drafts accepted, forwards that "
                                   "gave tokens; absent in results that predate it",
                    "required": ["draft_tokens", "accepted_tokens", "forward_steps"],
                    "additionalProperties": False,
                    "properties": {"draft_tokens": {"type": "integer"}, "accepted_tokens": {"type": "integer"},
                                   "forward_steps": {"type": "integer"}},
                },
                "bound": {
                    "type": "object",
                    "description": "the memory-bandwidth bound of one decode step at the mean decode context",
                    "required": ["context", "bytes_per_step", "weight_bytes_per_step", "cache_bytes_per_step",
                                 "experts_per_moe_layer", "ms", "ratio"],
                    "additionalProperties": False,
                    "properties": {
                        "context": {"type": "number"},
                        "bytes_per_step": {"type": "number"},
                        "weight_bytes_per_step": {"type": "number"},
                        "cache_bytes_per_step": {"type": "number"},
                        "experts_per_moe_layer": {"type": "number"},
                        "ms": _NUMBER_OR_NULL,
                        "ratio": {"type": ["number", "null"], "description": "median tpot / bound ms"},
                    },
                },
                "baseline": {
                    "oneOf": [{"type": "null"}, {
                        "type": "object",
                        "required": ["ttft_ms", "tpot_ms", "prefill_tokens_per_s", "batch_tokens_per_s",
                                     "peak_rss_bytes", "ttft_ratio", "tpot_ratio", "ttft_ratio_paired",
                                     "tpot_ratio_paired"],
                        "additionalProperties": False,
                        "properties": {
                            "ttft_ms": {"$ref": "#/$defs/summary"},
                            "tpot_ms": {"$ref": "#/$defs/summary"},
                            "prefill_tokens_per_s": {"$ref": "#/$defs/summary"},
                            "batch_tokens_per_s": {"$ref": "#/$defs/summary"},
                            "peak_rss_bytes": _INT_OR_NULL,
                            "ttft_ratio": {"type": ["number", "null"], "description": "baseline / ours, medians"},
                            "tpot_ratio": {"type": ["number", "null"], "description": "baseline / ours, medians"},
                            "ttft_ratio_paired": {"$ref": "#/$defs/summary_or_null"},
                            "tpot_ratio_paired": {"$ref": "#/$defs/summary_or_null"},
                        },
                    }],
                },
            },
        },
    },
    "required": ["schema", "schema_version", "created", "command", "wall_seconds", "device", "provider", "threads",
                 "versions", "artifact", "settings", "bandwidth", "memory", "baseline", "load_seconds", "cells",
                 "notes"],
    "additionalProperties": False,
    "properties": {
        "schema": {"const": SCHEMA_NAME},
        "schema_version": {"const": SCHEMA_VERSION},
        "created": {"type": "string", "description": "UTC, ISO 8601"},
        "command": {"type": "string"},
        "wall_seconds": {"type": "number", "description": "the whole run, loading included"},
        "device": {
            "type": "object",
            "required": ["kind", "label", "slug", "cpu", "gpu"],
            "additionalProperties": False,
            "properties": {
                "kind": {"enum": ["cpu", "gpu"]},
                "label": {"type": "string", "description": "e.g. 'AMD EPYC, 2 cores, 24 GiB', 'NVIDIA H200, 140 GiB'"},
                "slug": {"type": "string", "pattern": "^[a-z0-9]+(-[a-z0-9]+)*$",
                         "description": "the label as a folder name: DIR/<slug>/"},
                "cpu": {
                    "type": "object",
                    "required": ["model", "cores", "memory_bytes", "memory_gib"],
                    "properties": {
                        "model": {"type": "string"},
                        "cores": {"type": "integer", "minimum": 1},
                        "memory_bytes": _INT_OR_NULL,
                        "memory_gib": _INT_OR_NULL,
                        "machine": {"type": "string"},
                    },
                },
                "gpu": {"oneOf": [{"type": "null"}, {
                    "type": "object",
                    "required": ["name", "memory_bytes", "memory_gib", "count"],
                    "properties": {"name": {"type": "string"}, "memory_bytes": _INT_OR_NULL,
                                   "memory_gib": _INT_OR_NULL, "count": {"type": "integer"},
                                   "note": {"type": "string"}},
                }]},
            },
        },
        "provider": {"enum": ["cpu", "cuda", "tensorrt"], "description": "ONNX Runtime's execution provider"},
        "backend": {"enum": ["onnxruntime", "tensorrt"],
                    "description": "what ran the artifact: ONNX Runtime (with `provider`) or the TensorRT engines of "
                                   "`k2deploy build-engines`; absent in results that predate it: onnxruntime"},
        "threads": {"type": ["integer", "null"], "description": "the size of the process's one intra-op thread pool; null: no host pool (TensorRT)"},
        "speculative": {"enum": ["auto", "off"], "description": "--speculative: drafted tokens checked where they "
                                                              "pay (auto) or one token a forward (off); absent in "
                                                              "results that predate it"},
        "decode_kernels": {"type": ["string", "null"],
                           "description": "what ran one sequence's decode step: native (runtime/backends/native/decoder.py) or "
                                          "onnx (the graphs; with the reason where native was asked for by auto and "
                                          "could not run); null: another backend; absent in results that predate it"},
        "versions": {"type": "object", "required": ["k2deploy", "onnxruntime", "numpy", "python"],
                     "additionalProperties": _STRING_OR_NULL},
        "artifact": {
            "type": "object",
            "required": ["path", "manifest_sha256", "format_version", "model_type", "layers", "layer_structures", "hidden_size",
                         "n_routed_experts", "num_experts_per_tok", "vocab_size", "kv_cache", "checkpoint"],
            "properties": {
                "path": {"type": "string"},
                "manifest_sha256": {"type": "string", "pattern": "^[0-9a-f]{64}$"},
                "format_version": {"type": "integer"},
                "model_type": {"type": "string"},
                "layers": {"type": "integer"},
                "layer_structures": {"type": "array", "items": {"type": "string"},
                                     "description": "per decoder layer: dense or moe"},
                "hidden_size": {"type": "integer"},
                "n_routed_experts": {"type": ["integer", "null"]},
                "num_experts_per_tok": {"type": ["integer", "null"]},
                "vocab_size": {"type": "integer"},
                "kv_cache": {"enum": ["fp8", "int8", "bf16"]},
                "target": {"enum": ["cpu", "cuda", "tensorrt"], "description": "what the weights were lowered for"},
                "checkpoint": _STRING_OR_NULL,
            },
        },
        "settings": {
            "type": "object",
            "required": ["batches", "prompt_lens", "gen_len", "repeats", "warmup", "warmup_gen_len", "seed",
                         "sampling", "baseline"],
            "properties": {
                "batches": {"type": "array", "items": {"type": "integer", "minimum": 1}, "minItems": 1},
                "prompt_lens": {"type": "array", "items": {"type": "integer", "minimum": 1}, "minItems": 1},
                "gen_len": {"type": "integer", "minimum": 2},
                "repeats": {"type": "integer", "minimum": 1},
                "warmup": {"type": "integer", "minimum": 0},
                "warmup_gen_len": {"type": "integer"},
                "seed": {"type": "integer"},
                "sampling": {"type": "string"},
                "baseline": {"enum": ["eager", "hf", "none"]},
            },
        },
        "bandwidth": {
            "type": "object",
            "required": ["method", "bytes_per_array", "gb_per_s"],
            "properties": {"method": {"type": "string"}, "bytes_per_array": {"type": "integer"},
                           "gb_per_s": {"$ref": "#/$defs/summary", "description": "before and after the runs"}},
        },
        "memory": {
            "type": "object",
            "required": ["weights_bytes", "weights_rss_bytes", "kv_bytes_per_token_per_layer", "kv_bytes_per_token",
                         "peak_rss_bytes", "device_memory_bytes"],
            "additionalProperties": False,
            "properties": {
                "weights_bytes": {"type": "integer", "description": "the artifact's graphs and weights on disk"},
                "weights_rss_bytes": {"type": ["integer", "null"], "description": "RSS the loaded sessions added"},
                "kv_bytes_per_token_per_layer": {"type": "integer"},
                "kv_bytes_per_token": {"type": "integer"},
                "peak_rss_bytes": _INT_OR_NULL,
                "device_memory_bytes": {"type": ["integer", "null"], "description": "GPU providers: nvidia-smi's "
                                        "figure for this process"},
            },
        },
        "baseline": {"oneOf": [{"type": "null"}, {
            "type": "object",
            "required": ["kind", "checkpoint", "threads", "load_seconds", "peak_rss_bytes", "device"],
            "properties": {"kind": {"enum": ["eager", "hf"]}, "checkpoint": {"type": "string"},
                           "threads": _INT_OR_NULL, "load_seconds": _NUMBER_OR_NULL,
                           "peak_rss_bytes": _INT_OR_NULL, "device": {"type": "string"}},
        }]},
        "load_seconds": {"type": "number"},
        "cells": {"type": "array", "items": {"$ref": "#/$defs/cell"}, "minItems": 1},
        "notes": {"type": "array", "items": {"type": "string"}},
    },
}


def validate(document: dict) -> None:
    """Raises jsonschema.ValidationError where the document does not match SCHEMA."""
    import jsonschema

    jsonschema.validate(document, SCHEMA, cls=jsonschema.Draft202012Validator)
