"""The `serve` command: its arguments, and starting the server (uvicorn) on an artifact.

Importing this module is cheap (argparse only), so `k2deploy --help` stays fast; the server's
libraries load when the command runs.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import re
import socket
import sys
import threading
from pathlib import Path

from ..core.errors import K2Error
from ..core.json_files import read_small_text
from ..runtime.serve.connections import DEFAULT_HEADER_TIMEOUT_S, DEFAULT_MAX_CONNECTIONS
from ..runtime.serve.protocol import DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_REQUEST_BYTES
from .runtime_options import add_runtime_options, add_speculative_option

MAX_BATCH = 4096  # requests running at once, at most (each is a row of every forward)
DEFAULT_DRAIN_TIMEOUT_S = 30.0
MAX_TIMEOUT_S = 7 * 24 * 3600.0  # the longest of the server's timeouts
DRAIN_GRACE_S = 5.0  # after the drain ends, time for the failed requests' last events to reach their clients
API_KEY_VARIABLE = "K2DEPLOY_API_KEY"
KEY_FILE_BYTES = 4096  # an --api-key-file, at most
DESCRIPTION = ("Serve an exported artifact over OpenAI's API (GET /v1/models, POST /v1/completions and "
               "/v1/chat/completions, streamed or not) with continuous batching over the FP8 latent cache, "
               "plus GET /health and Prometheus GET /metrics. SIGTERM or Ctrl-C drains running requests, then exits.")


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("artifact", help="artifact directory written by `k2deploy export` (with its tokenizer)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    parser.add_argument("--port", type=int, default=8000, help="TCP port, 0 for any free one (default: 8000)")
    parser.add_argument("--max-batch", type=int, default=8,
                        help="requests running at once (each holds pages of the cache's pool as it grows; "
                             "default: 8)")
    parser.add_argument("--max-queue", type=int, default=64,
                        help="requests that may wait for a slot or for pages; beyond that: 503 with Retry-After "
                             "(default: 64)")
    parser.add_argument("--max-context", type=int,
                        help="positions one request may reach (prompt plus completion); reserves nothing (default "
                             "and most: the model's max_position_embeddings)")
    parser.add_argument("--max-total-tokens", type=int,
                        help="the cache's page pool, in tokens, shared by all requests: allocated once at start "
                             f"(default: half the memory available after the weights, at most max-batch x "
                             f"max-context; the start line says how much)")
    parser.add_argument("--no-prefix-cache", action="store_true",
                        help="do not reuse the cached pages of a prompt's prefix that an earlier request computed "
                             "(default: reuse them)")
    parser.add_argument("--api-key", help="require `Authorization: Bearer KEY` on every route but /health (visible to "
                                           f"other users in `ps`: prefer --api-key-file or ${API_KEY_VARIABLE})")
    parser.add_argument("--api-key-file", help="read the API key from this file's first line")
    parser.add_argument("--allow-origin", action="append", default=[], metavar="ORIGIN",
                        help="a web origin (e.g. https://app.example.com) whose pages may call the API from a "
                             "browser (CORS); repeat for several (default: none, no CORS headers are sent)")
    parser.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                        help=f"largest request body; larger ones get 413 (default: {DEFAULT_MAX_REQUEST_BYTES})")
    parser.add_argument("--body-timeout", type=float, default=DEFAULT_BODY_TIMEOUT_S,
                        help=f"seconds a client has to send its whole request body, else a 408 (default: "
                             f"{DEFAULT_BODY_TIMEOUT_S:g})")
    parser.add_argument("--header-timeout", type=float, default=DEFAULT_HEADER_TIMEOUT_S,
                        help="seconds a client has to send a request's headers after it connects or after its last "
                             f"answer, else its connection is closed (default: {DEFAULT_HEADER_TIMEOUT_S:g})")
    parser.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS,
                        help="open connections served at once; a request on one more gets a 503 and its connection "
                             f"is closed (default: {DEFAULT_MAX_CONNECTIONS})")
    parser.add_argument("--drain-timeout", type=float, default=DEFAULT_DRAIN_TIMEOUT_S,
                        help="seconds SIGTERM waits for running requests before it exits anyway; a second SIGTERM "
                             f"exits at once (default: {DEFAULT_DRAIN_TIMEOUT_S:g})")
    parser.add_argument("--model-name", help="the model id clients send (default: the artifact folder's name)")
    add_runtime_options(parser)
    add_speculative_option(parser)
    parser.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"], default="info",
                        help="uvicorn's and the engine's log level; info logs every request and every "
                             "failed one (default: info)")


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    """Registers `k2deploy serve` on the main parser's subcommands."""
    serve = subparsers.add_parser("serve", help="serve an artifact over an OpenAI-compatible HTTP API (no torch)",
                                  description=DESCRIPTION)
    add_serve_arguments(serve)
    serve.set_defaults(func=cmd_serve)
    return serve


def cmd_serve(args: argparse.Namespace) -> None:
    for name in ("max_batch", "max_context", "max_total_tokens"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise K2Error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.max_batch > MAX_BATCH:
        raise K2Error(f"--max-batch {args.max_batch} is more than this server runs at once ({MAX_BATCH}); ask for "
                      f"fewer and let --max-queue hold the rest")
    if args.max_queue < 0:
        raise K2Error(f"--max-queue must be at least 0, got {args.max_queue}")
    if not 0 <= args.port <= 65535:
        raise K2Error(f"--port {args.port} is not a TCP port; choose 0 to 65535 (0: any free port)")
    if args.max_request_bytes < 1024:
        raise K2Error(f"--max-request-bytes must be at least 1024, got {args.max_request_bytes}")
    if not args.body_timeout > 0:
        raise K2Error(f"--body-timeout must be more than 0 seconds, got {args.body_timeout}")
    if not args.header_timeout > 0:
        raise K2Error(f"--header-timeout must be more than 0 seconds, got {args.header_timeout}")
    if args.max_connections < 1:
        raise K2Error(f"--max-connections must be at least 1, got {args.max_connections}")
    if not args.drain_timeout >= 0:
        raise K2Error(f"--drain-timeout must be at least 0 seconds, got {args.drain_timeout}")
    for option in ("body_timeout", "header_timeout", "drain_timeout"):  # a timer past this overflows the clock
        if getattr(args, option) > MAX_TIMEOUT_S:
            raise K2Error(f"--{option.replace('_', '-')} must be at most {MAX_TIMEOUT_S:g} seconds (a week), got "
                          f"{getattr(args, option):g}")
    for origin in args.allow_origin:
        if origin != "*" and not re.fullmatch(r"https?://[^/\s]+", origin):
            raise K2Error(f"--allow-origin {origin!r} is not an origin; give scheme and host, e.g. "
                          f"https://app.example.com or http://localhost:3000 (* for any)")
    api_key = _api_key(args)
    try:
        import uvicorn
        from uvicorn.protocols.http.auto import AutoHTTPProtocol

        from ..runtime.serve.app import build_app
    except ImportError as exc:
        raise K2Error(f"serving needs the serve extra ({exc.name} is missing): pip install 'k2deploy[serve]'") from None
    from ..core.manifest import load_manifest
    from ..core.tokenizer_files import load_tokenizer
    from ..runtime.engine.config import resolve_engine_config
    from ..runtime.loading import load_backend
    from ..runtime.serve.connections import with_header_deadline
    from ..runtime.serve.engine_thread import Engine
    from ..runtime.serve.metrics import ServerMetrics

    artifact = Path(args.artifact)
    manifest = load_manifest(artifact, hash_graphs=False)  # each graph hashed as it is opened, a stage's by the stage
    tokenizer = load_tokenizer(artifact / "tokenizer", manifest.config.vocab_size)  # None: token-id prompts only
    config = resolve_engine_config(manifest, args, max_batch=args.max_batch, max_context=args.max_context,
                                   cache_tokens=args.max_total_tokens, max_queue=args.max_queue,
                                   prefix_cache=not args.no_prefix_cache)
    model = load_backend(manifest, config)
    metrics = ServerMetrics()
    engine = Engine(model, config, metrics)
    model_name = args.model_name or artifact.resolve().name
    app = build_app(engine, tokenizer, model_name, metrics, api_key=api_key, max_request_bytes=args.max_request_bytes,
                    body_timeout=args.body_timeout,
                    allow_origins=tuple(args.allow_origin))
    listener = _bind(args.host, args.port)
    host, port = listener.getsockname()[:2]
    warning = exposure_warning(host, api_key)
    if warning:
        print(f"k2deploy serve: warning: {warning}", file=sys.stderr, flush=True)
    pool = engine.cache.pool
    print(f"k2deploy serve: {model_name} on http://{_url_host(host)}:{port}/v1 (max batch {config.max_batch}, "
          f"context {engine.context}, cache pool {pool.pages * pool.page_size} tokens in {pool.pages} pages of "
          f"{pool.page_size}, {engine.pool_tokens * config.cache_token_bytes / 2**20:.1f} MiB "
          f"{manifest.kv_cache['format']}, prefix cache {'on' if pool.prefix_cache else 'off'}, "
          f"{config.provider if config.backend == 'onnxruntime' else config.backend}"
          + (f", {model.threads} threads" if model.threads else "")
          + (f", decode {model.decode_kernels}" if getattr(model, "decode_kernels", None) else "") + ")"
          + ("" if tokenizer else "; no tokenizer: token-id prompts to /v1/completions only"), flush=True)
    logging.basicConfig(format="k2deploy serve: %(levelname)s %(message)s")
    logging.getLogger("k2deploy").setLevel(args.log_level.upper())
    def end_drain() -> None:  # requests still running when the drain ends hear why, then their streams close
        engine.stop(f"the server shut down before this request finished (--drain-timeout {args.drain_timeout:g} s)")

    # uvicorn cancels what is still open after its own timeout: later than ours, so every stream ends with its error
    # uvicorn counts the connection asking among its limit_concurrency: one more, so --max-connections are served
    server = _draining_server(uvicorn.Config(app, log_level=args.log_level,
                                             http=with_header_deadline(AutoHTTPProtocol, args.header_timeout),
                                             limit_concurrency=args.max_connections + 1,
                                             timeout_graceful_shutdown=args.drain_timeout + DRAIN_GRACE_S),
                              lambda: _after(args.drain_timeout, end_drain))
    server.run(sockets=[listener])


def _api_key(args: argparse.Namespace) -> str | None:
    """--api-key, else the first line of --api-key-file, else $K2DEPLOY_API_KEY, without the spaces around it
    (an HTTP header's value never carries them, so a key with them could never match); an empty key is refused."""
    if args.api_key is not None:
        key, source = args.api_key, "--api-key"
    elif args.api_key_file:
        lines = read_small_text(args.api_key_file, KEY_FILE_BYTES, "--api-key-file").splitlines()
        key, source = (lines[0].strip() if lines else ""), f"--api-key-file {args.api_key_file}"
    elif API_KEY_VARIABLE in os.environ:
        key, source = os.environ[API_KEY_VARIABLE], f"${API_KEY_VARIABLE}"
    else:
        return None
    if not key.strip():
        raise K2Error(f"{source} is empty: an empty key would let anyone in; give a key or none at all")
    return key.strip()


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """What to tell the user who serves on an address other machines can reach, with no key to keep them out."""
    if api_key is not None or ipaddress.ip_address(host).is_loopback:
        return None
    return (f"listening on {host}, reachable from other machines, without an API key: anyone who can reach it can "
            f"generate (give --api-key-file, or bind 127.0.0.1)")


def _after(seconds: float, call) -> None:
    """call() in `seconds` on a thread that does not keep the process alive."""
    timer = threading.Timer(seconds, call)
    timer.daemon = True
    timer.start()


def _draining_server(config, on_drain):
    """uvicorn's server, where the first SIGTERM or Ctrl-C starts the drain (and calls on_drain) and a second one
    (not only a second Ctrl-C) ends it at once."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            if self.should_exit:
                print("k2deploy serve: second signal, exiting without waiting for running requests", file=sys.stderr,
                      flush=True)
                os._exit(128 + sig)
            on_drain()
            super().handle_exit(sig, frame)

    return DrainingServer(config)


def _bind(host: str, port: int) -> socket.socket:
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        return socket.create_server((host, port), family=family, backlog=2048)
    except OSError as exc:
        raise K2Error(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
