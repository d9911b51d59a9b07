"""The HTTP routes (Starlette): OpenAI's models, completions and chat completions, /health and /metrics.

Handlers check and tokenise a request, hand it to the engine and relay its updates, as one
JSON response or as server-sent events. The engine's thread delivers updates into the
handler's asyncio queue with call_soon_threadsafe. A client that goes away marks its request
cancelled; the engine frees its slot at the next step.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import jinja2
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ...core.chat_template import ChatTokenizer
from ...core.errors import K2Error
from ..chat_tools import ToolSteering
from ..constrained import Constraint, GrammarError, Grammars, json_grammar, tools_grammar
from ..sampling import SamplingParams
from ..tool_calls import ToolCallParser
from .engine import Engine
from .metrics import ServerMetrics
from .protocol import (SSE_DONE, ApiError, Options, Reply, bad_request, logprobs_object, max_new_tokens, models_list,
                       parse_json, parse_options, sse, usage)
from ..requests import GenerationRequest, Update
from ..scheduler import QueueFull

OPEN_ROUTES = {"/health"}  # reachable without the API key
RETRY_AFTER_S = "1"
DEFAULT_MAX_REQUEST_BYTES = 4 << 20
DEFAULT_BODY_TIMEOUT_S = 30.0


class Service:
    """What the routes serve: the engine, the artifact's tokenizer (None: token ids only) and the model's name."""

    def __init__(self, engine: Engine, tokenizer: ChatTokenizer | None, model_name: str, metrics: ServerMetrics,
                 max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, body_timeout: float = DEFAULT_BODY_TIMEOUT_S):
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.metrics = metrics
        self.max_request_bytes = max_request_bytes
        self.body_timeout = body_timeout
        self.grammars: Grammars | None = None  # the vocabulary in the grammar engine's form, made on first use
        self.created = int(time.time())

    async def health(self, request: Request) -> Response:
        problem = await asyncio.to_thread(self.engine.health)
        if problem is None:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": problem}, status_code=503, headers={"Retry-After": RETRY_AFTER_S})

    async def metrics_text(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type=self.metrics.content_type)

    async def models(self, request: Request) -> Response:
        return JSONResponse(models_list(self.model_name, self.created, self.engine.context))

    async def model(self, request: Request) -> Response:
        """GET /v1/models/{id}: the served model, or a 404 model_not_found."""
        name = request.path_params["model"]
        if name != self.model_name:
            raise ApiError(404, f"The model `{name}` does not exist; this server serves `{self.model_name}`.",
                           param="model", code="model_not_found")
        return JSONResponse(models_list(self.model_name, self.created, self.engine.context)["data"][0])

    async def completions(self, request: Request) -> Response:
        return await self.generate(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self.generate(request, chat=True)

    async def generate(self, request: Request, chat: bool) -> Response:
        problem = await asyncio.to_thread(self.engine.health)
        if problem is not None:
            raise ApiError(503, f"The model is unavailable: {problem}. Retry after a moment.", type="server_error",
                           code="unavailable", headers={"Retry-After": RETRY_AFTER_S})
        media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
        if media_type != "application/json":  # a web page can send text/plain across origins without asking first
            raise ApiError(415, f"Send the request body as JSON with `Content-Type: application/json` (got "
                                f"{media_type or 'no Content-Type'}).", code="unsupported_media_type")
        body = await self.read_body(request)
        # parsing and tokenising a large body takes time: off the event loop, so /health and streams keep answering
        options = await asyncio.to_thread(lambda: parse_options(parse_json(body), chat))
        if options.model != self.model_name:
            raise ApiError(404, f"The model `{options.model}` does not exist; this server serves `{self.model_name}`.",
                           param="model", code="model_not_found")
        prompt_ids, steering = await asyncio.to_thread(self.prompt_ids, options)
        constraint = await asyncio.to_thread(self.constraint, options, steering)
        vocab = self.engine.model.config.vocab_size
        outside = [token for token, _ in options.logit_bias if token >= vocab]
        if outside:
            raise bad_request(f"`logit_bias` names token {outside[0]}, outside the vocabulary [0, {vocab}).",
                              param="logit_bias")
        params = SamplingParams(temperature=options.temperature, top_p=options.top_p, seed=options.seed,
                                max_new_tokens=max_new_tokens(options, len(prompt_ids), self.engine.context),
                                stop_ids=tuple(self.tokenizer.stop_ids) if self.tokenizer else (),
                                banned_ids=steering.banned_ids, top_k=options.top_k, min_p=options.min_p,
                                presence_penalty=options.presence_penalty, frequency_penalty=options.frequency_penalty,
                                repetition_penalty=options.repetition_penalty, logit_bias=options.logit_bias,
                                logprobs=options.logprobs)
        updates: asyncio.Queue[Update | None] = asyncio.Queue()  # None: the client went away
        loop = asyncio.get_running_loop()
        tokenizer = self.tokenizer
        job = GenerationRequest(prompt_ids, params, options.stop,
                                (lambda ids: tokenizer.decode(ids, skip_special=True)) if tokenizer else None,
                                deliver=lambda update: loop.call_soon_threadsafe(updates.put_nowait, update),
                                parser=ToolCallParser() if chat else None, forced_text=steering.forced_text,
                                single_call=not options.parallel_tool_calls, constraint=constraint)
        try:
            self.engine.submit(job)
        except K2Error as exc:  # the prompt does not fit the context or the whole cache
            raise bad_request(f"{exc}.", param="messages" if chat else "prompt", code="context_length_exceeded") from None
        except QueueFull:
            raise ApiError(503, "The server is at capacity: every cache slot is taken and the queue is full. "
                                "Retry after a moment.", type="server_busy", code="queue_full",
                           headers={"Retry-After": RETRY_AFTER_S}) from None
        reply = Reply.new(chat, self.model_name)
        logprobs = None if options.logprobs is None else lambda entries, offset=0: logprobs_object(
            chat, entries, self.token_bytes, offset)
        if options.stream:
            return GenerationStream(self.events(job, updates, reply, options.include_usage, logprobs), job)
        return await self.collect(request, job, updates, reply, logprobs)

    def constraint(self, options: Options, steering: ToolSteering) -> Constraint | None:
        """The grammar the answer must keep to: a JSON value for response_format, the declared tools' calls when
        tools may be called; None when the answer is free."""
        tools = options.tools if options.tool_choice != "none" else None
        if not (options.json_answer or tools):
            return None
        if self.tokenizer is None:
            raise bad_request("`response_format` JSON needs the artifact's tokenizer, which it does not have.",
                              param="response_format")
        if self.grammars is None:
            self.grammars = Grammars(self.tokenizer, self.engine.model.config.vocab_size)
        try:
            if options.json_answer:
                return self.grammars.constraint(json_grammar(options.json_schema))
            grammar = tools_grammar(tools, options.tool_choice, single_call=not options.parallel_tool_calls)
            return self.grammars.constraint(grammar, steering.forced_ids(self.tokenizer))
        except GrammarError as exc:
            raise bad_request(f"{exc}.", param="response_format" if options.json_answer else "tools") from None

    def token_bytes(self, token: int) -> bytes:
        """A token as logprobs name it: its bytes (special tokens' names), or `token_id:N` without a tokenizer."""
        return self.tokenizer.token_bytes(token) if self.tokenizer else f"token_id:{token}".encode()

    async def read_body(self, request: Request) -> bytes:
        """The request body, refused with a 413 as soon as it is known to exceed --max-request-bytes, and with a
        408 when it has not all arrived within --body-timeout seconds (a client that promises a body and stalls
        would otherwise hold its connection forever)."""
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_request_bytes:
            raise _too_large(self.max_request_bytes)
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.body_timeout):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > self.max_request_bytes:
                        raise _too_large(self.max_request_bytes)
                    chunks.append(chunk)
        except TimeoutError:
            raise ApiError(408, f"The request body did not arrive within {self.body_timeout:g} s (--body-timeout).",
                           code="request_timeout", headers={"Connection": "close"}) from None
        return b"".join(chunks)

    def prompt_ids(self, options: Options) -> tuple[list[int], ToolSteering]:
        """The prompt's token ids (with any tokens tool_choice forces the answer to begin with) and the steering."""
        if self.tokenizer is None and (options.chat or isinstance(options.prompt, str)):
            raise bad_request("This artifact has no tokenizer, so it takes no text: send `prompt` to /v1/completions "
                              "as an array of token ids.", param="messages" if options.chat else "prompt",
                              code="no_tokenizer")
        if self.tokenizer is None and options.stop:
            raise bad_request("`stop` strings need a tokenizer, which this artifact does not have.", param="stop")
        if options.chat:
            try:
                steering = ToolSteering.plan(self.tokenizer, options.tools, options.tool_choice)
                ids = self.tokenizer.encode_chat(options.messages, options.tools)
            except (jinja2.TemplateError, K2Error) as exc:  # K2Error: no chat template, or no tool-call tokens
                raise bad_request(f"The chat template cannot render these messages: {exc}", param="messages") from None
            return ids + steering.forced_ids(self.tokenizer), steering
        if isinstance(options.prompt, str):
            return self.tokenizer.encode(options.prompt), ToolSteering("", ())
        vocab = self.engine.model.config.vocab_size
        outside = [t for t in options.prompt if not 0 <= t < vocab]
        if outside:
            raise bad_request(f"Token id {outside[0]} in `prompt` is outside the vocabulary [0, {vocab}).",
                              param="prompt")
        return list(options.prompt), ToolSteering("", ())

    async def collect(self, request: Request, job: GenerationRequest, updates: asyncio.Queue, reply: Reply,
                      logprobs) -> Response:
        """A whole (non-streamed) answer; stops waiting, and cancels the request, if the client disconnects.
        logprobs: None, or entries -> OpenAI's logprobs object."""
        watcher = asyncio.create_task(_watch_disconnect(request, job, updates))
        try:
            parts, calls, entries = [], ToolCallsAssembly(), []
            while (update := await updates.get()) is not None:
                if update.error:
                    raise ApiError(500, update.error, type="server_error")
                parts.append(update.text)
                calls.add(update.tool_calls)
                entries += update.logprobs
                if update.finish_reason:
                    counts = usage(len(job.prompt_ids), len(job.generated), job.cached_prompt_tokens or 0)
                    return JSONResponse(reply.response("".join(parts), update.finish_reason, counts, calls.calls,
                                                       None if self.tokenizer else list(job.generated),
                                                       logprobs(entries) if logprobs else None))
            return Response(status_code=499)  # nobody is listening any more
        finally:
            watcher.cancel()

    async def events(self, job: GenerationRequest, updates: asyncio.Queue, reply: Reply,
                     include_usage: bool, logprobs) -> AsyncIterator[str]:
        """OpenAI's stream: a chunk per token (its text may be empty while a character or a possible stop
        string is incomplete, so the first chunk marks the first token), the finish reason, [usage,] [DONE]."""
        if reply.chat:
            yield sse(reply.chunk("", role=True))
        offset = 0  # completions' text_offset of the next token
        while True:
            update = await updates.get()
            if update.error:
                yield sse(ApiError(500, update.error, type="server_error").body())
                break
            calls = [c.to_openai() for c in update.tool_calls]
            ids = None if self.tokenizer else list(update.token_ids)
            chunk_logprobs = logprobs(update.logprobs, offset) if logprobs and update.logprobs else None
            offset += sum(len(self.token_bytes(e.token).decode("utf-8", "replace")) for e in update.logprobs)
            yield sse(reply.chunk(update.text, update.finish_reason, tool_calls=calls, token_ids=ids,
                                  logprobs=chunk_logprobs))
            if update.finish_reason:
                if include_usage:
                    yield sse(reply.usage_chunk(usage(len(job.prompt_ids), len(job.generated), job.cached_prompt_tokens or 0)))
                break
        yield SSE_DONE


class ToolCallsAssembly:
    """A whole answer's tool calls from its streamed deltas, in OpenAI's message shape."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def add(self, deltas) -> None:
        for delta in deltas:
            if delta.id is not None:
                self.calls.append({"id": delta.id, "type": "function",
                                   "function": {"name": delta.name, "arguments": ""}})
            self.calls[delta.index]["function"]["arguments"] += delta.arguments


class GenerationStream(StreamingResponse):
    """Server-sent events that cancel their request however the response ends (finished, disconnected, failed)."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], job: GenerationRequest):
        super().__init__(events, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.job = job

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.cancelled = True  # a no-op once it has finished


async def _watch_disconnect(request: Request, job: GenerationRequest, updates: asyncio.Queue) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
    job.cancelled = True
    updates.put_nowait(None)


class AuthMiddleware:
    """ASGI middleware: with an API key every route but /health needs `Authorization: Bearer KEY`;
    every answer is counted by route and status."""

    def __init__(self, app, api_key: str | None, metrics: ServerMetrics, routes: set[str]):
        self.app = app
        self.expected = api_key.encode() if api_key else None
        self.metrics = metrics
        self.routes = routes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        route = path if path in self.routes else "other"

        async def counted_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(route, str(message["status"])).inc()
            await send(message)

        if self.expected and path not in OPEN_ROUTES and not self._authorized(scope):
            error = ApiError(401, "Incorrect or missing API key: send `Authorization: Bearer <key>`.",
                             code="invalid_api_key")
            await _error_response(error)(scope, receive, counted_send)
            return
        await self.app(scope, receive, counted_send)

    def _authorized(self, scope) -> bool:
        scheme, _, key = dict(scope["headers"]).get(b"authorization", b"").strip().partition(b" ")
        return hmac.compare_digest(key.strip(), self.expected) and scheme.lower() == b"bearer"  # the scheme's case is free


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"The request body exceeds this server's limit of {limit} bytes (--max-request-bytes).",
                    code="request_too_large")


def _error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


async def _api_error(request: Request, exc: ApiError) -> Response:
    return _error_response(exc)


async def _http_error(request: Request, exc: HTTPException) -> Response:
    """Starlette's own errors (unknown route, wrong method) in OpenAI's shape."""
    kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    error = ApiError(exc.status_code, f"{exc.detail}: {request.method} {request.url.path}", code=kind,
                     headers=dict(exc.headers or {}))
    return _error_response(error)


async def _server_error(request: Request, exc: Exception) -> Response:
    return _error_response(ApiError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error"))


def build_app(engine: Engine, tokenizer: ChatTokenizer | None, model_name: str, metrics: ServerMetrics,
              api_key: str | None = None, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
              body_timeout: float = DEFAULT_BODY_TIMEOUT_S,
              allow_origins: tuple[str, ...] = ()) -> Starlette:
    """allow_origins: the web origins whose pages may call the API (CORS); none by default, so a browser keeps
    every other site's scripts from reading answers."""
    service = Service(engine, tokenizer, model_name, metrics, max_request_bytes, body_timeout)
    routes = [
        Route("/health", service.health, methods=["GET"]),
        Route("/metrics", service.metrics_text, methods=["GET"]),
        Route("/v1/models", service.models, methods=["GET"]),
        Route("/v1/models/{model:path}", service.model, methods=["GET"]),
        Route("/v1/completions", service.completions, methods=["POST"]),
        Route("/v1/chat/completions", service.chat_completions, methods=["POST"]),
    ]

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        engine.start()
        yield
        await asyncio.to_thread(engine.stop)

    middleware = [Middleware(CORSMiddleware, allow_origins=list(allow_origins), allow_methods=["GET", "POST"],
                             allow_headers=["Authorization", "Content-Type"])] if allow_origins else []
    middleware.append(Middleware(AuthMiddleware, api_key=api_key, metrics=metrics, routes={r.path for r in routes}))
    return Starlette(routes=routes, lifespan=lifespan, middleware=middleware,
                     exception_handlers={ApiError: _api_error, HTTPException: _http_error, Exception: _server_error})
