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
from dataclasses import dataclass
from functools import partial

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
from ..text.chat_tools import ToolSteering, calls_made
from ..text.constrained import Constraint, GrammarError, Grammars, json_grammar, thinking_mode, tools_grammar
from ..text.answer import answer_stream
from ..engine.sampling import SamplingParams
from .engine_thread import Engine
from .metrics import ServerMetrics
from .protocol import (DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_REQUEST_BYTES, SSE_DONE, ApiError, Options, Reply, bad_request, logprobs_object, max_new_tokens, models_list,
                       parse_json, parse_options, sse, usage)
from ..engine.requests import GenerationRequest, Update
from ..engine.scheduler import QueueFull

OPEN_ROUTES = {"/health"}  # reachable without the API key
RETRY_AFTER_S = "1"


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
        vocab = self.engine.model.config.vocab_size
        outside = [token for token, _ in options.logit_bias if token >= vocab]
        if outside:
            raise bad_request(f"`logit_bias` names token {outside[0]}, outside the vocabulary [0, {vocab}).",
                              param="logit_bias")
        prompts = await asyncio.to_thread(lambda: [self.prompt_ids(options, p) for p in options.prompts or [None]])
        updates: asyncio.Queue[tuple[int, Update] | None] = asyncio.Queue()  # None: the client went away
        loop = asyncio.get_running_loop()
        jobs = []
        for prompt_ids, steering in prompts:
            params = self.sampling(options, steering, max_new_tokens(options, len(prompt_ids), self.engine.context))
            for row in range(options.n):  # the choices of one prompt: the scheduler has the first prefill, the
                # others reuse its pages
                constraint = await asyncio.to_thread(self.constraint, options, steering, prompt_ids)
                jobs.append(self.job(prompt_ids, params, options, steering, constraint, row,
                                     deliver=partial(_deliver, loop, updates, len(jobs))))
        self.submit(jobs, chat)
        reply = Reply.new(chat, self.model_name)
        logprobs = None if options.logprobs is None else lambda entries, offset=0: logprobs_object(
            chat, entries, self.token_bytes, offset)
        answer = Answer(jobs, len(prompts), updates, reply, logprobs)
        if options.stream:
            return GenerationStream(self.events(answer, options.include_usage, options.continuous_usage), jobs)
        return await self.collect(request, answer)

    def sampling(self, options: Options, steering: ToolSteering, max_new: int) -> SamplingParams:
        return SamplingParams(temperature=options.temperature, top_p=options.top_p, seed=options.seed,
                              max_new_tokens=max_new, stop_ids=tuple(self.tokenizer.stop_ids) if self.tokenizer else (),
                              banned_ids=steering.banned_ids, top_k=options.top_k, min_p=options.min_p,
                              presence_penalty=options.presence_penalty, frequency_penalty=options.frequency_penalty,
                              repetition_penalty=options.repetition_penalty, logit_bias=options.logit_bias,
                              logprobs=options.logprobs)

    def job(self, prompt_ids: list[int], params: SamplingParams, options: Options, steering: ToolSteering,
            constraint: Constraint | None, row: int, deliver) -> GenerationRequest:
        answer = answer_stream(self.tokenizer, prompt_ids, options.chat, options.stop, steering.forced_text,
                               not options.parallel_tool_calls)
        return GenerationRequest(prompt_ids, params, deliver, row=row, constraint=constraint, answer=answer)

    def submit(self, jobs: list[GenerationRequest], chat: bool) -> None:
        """Queues every choice of the request, or none of them; a request of more choices than the slots and the
        queue hold together could never be queued: a 400 that names the limit, not a 503 to retry."""
        scheduler = self.engine.loop.scheduler
        room = len(scheduler.slots) + scheduler.max_queue
        if len(jobs) > room:
            raise bad_request(f"This request asks for {len(jobs)} generations (its prompts times n) and this server "
                              f"holds at most {room} at once ({len(scheduler.slots)} running, {scheduler.max_queue} "
                              f"waiting: --max-batch and --max-queue). Send fewer prompts or a smaller n.", param="n")
        try:
            for job in jobs:
                self.engine.submit(job)
        except (K2Error, QueueFull) as exc:
            for job in jobs:
                job.cancelled = True
            if isinstance(exc, K2Error):  # the prompt does not fit the context or the whole cache
                raise bad_request(f"{exc}.", param="messages" if chat else "prompt",
                                  code="context_length_exceeded") from None
            raise ApiError(503, "The server is at capacity: every cache slot is taken and the queue is full. "
                                "Retry after a moment.", type="server_busy", code="queue_full",
                           headers={"Retry-After": RETRY_AFTER_S}) from None

    def constraint(self, options: Options, steering: ToolSteering, prompt_ids: list[int]) -> Constraint | None:
        """The grammar the answer must keep to: a JSON value for response_format, the declared tools' calls when
        tools may be called (after the reasoning, where the model thinks); None when the answer is free."""
        tools = options.tools if options.tool_choice != "none" else None
        if not (options.json_answer or tools):
            return None
        if self.tokenizer is None:
            raise bad_request("`response_format` JSON needs the artifact's tokenizer, which it does not have.",
                              param="response_format")
        if self.grammars is None:
            self.grammars = Grammars(self.tokenizer, self.engine.model.config.vocab_size)
        thinking = thinking_mode(self.tokenizer, prompt_ids) if options.chat else None
        try:
            if options.json_answer:  # JSON from the first token, unless the prompt opened the reasoning
                return self.grammars.constraint(json_grammar(options.json_schema, "open" if thinking == "open" else None))
            grammar = tools_grammar(tools, options.tool_choice, not options.parallel_tool_calls, thinking)
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

    def prompt_ids(self, options: Options, prompt: str | list[int] | None) -> tuple[list[int], ToolSteering]:
        """A completions prompt's (or the chat's, prompt None) token ids (with any tokens tool_choice forces the
        answer to begin with) and the steering."""
        if self.tokenizer is None and (options.chat or isinstance(prompt, str)):
            raise bad_request("This artifact has no tokenizer, so it takes no text: send `prompt` to /v1/completions "
                              "as an array of token ids.", param="messages" if options.chat else "prompt",
                              code="no_tokenizer")
        if self.tokenizer is None and options.stop:
            raise bad_request("`stop` strings need a tokenizer, which this artifact does not have.", param="stop")
        if options.chat:
            try:
                steering = ToolSteering.plan(self.tokenizer, options.tools, options.tool_choice,
                                             calls_made(options.messages))
                ids = self.tokenizer.encode_chat(options.messages, options.tools, dict(options.template_options))
            except (jinja2.TemplateError, K2Error) as exc:  # K2Error: no chat template, or no tool-call tokens
                raise bad_request(f"The chat template cannot render these messages: {exc}", param="messages") from None
            return ids + steering.forced_ids(self.tokenizer), steering
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt), ToolSteering("", ())
        vocab = self.engine.model.config.vocab_size
        outside = [t for t in prompt if not 0 <= t < vocab]
        if outside:
            raise bad_request(f"Token id {outside[0]} in `prompt` is outside the vocabulary [0, {vocab}).",
                              param="prompt")
        return list(prompt), ToolSteering("", ())

    async def collect(self, request: Request, answer: Answer) -> Response:
        """The whole (non-streamed) answer, every choice; stops waiting, and cancels the choices, if the client
        disconnects."""
        watcher = asyncio.create_task(_watch_disconnect(request, answer.jobs, answer.updates))
        try:
            count = len(answer.jobs)
            parts, calls, entries = [[] for _ in range(count)], [ToolCallsAssembly() for _ in range(count)], \
                [[] for _ in range(count)]
            reasoning = [[] for _ in range(count)]
            finished: dict[int, str] = {}
            while len(finished) < count:
                if (item := await answer.updates.get()) is None:
                    return Response(status_code=499)  # nobody is listening any more
                index, update = item
                if update.error:
                    raise ApiError(500, update.error, type="server_error")
                parts[index].append(update.text)
                reasoning[index].append(update.reasoning)
                calls[index].add(update.tool_calls)
                entries[index] += update.logprobs
                if update.finish_reason:
                    finished[index] = update.finish_reason
            choices = [answer.reply.choice(i, "".join(parts[i]), finished[i], calls[i].calls,
                                           None if self.tokenizer else list(job.generated),
                                           answer.logprobs(entries[i]) if answer.logprobs else None,
                                           "".join(reasoning[i]))
                       for i, job in enumerate(answer.jobs)]
            return JSONResponse(answer.reply.response(choices, answer.usage()))
        finally:
            watcher.cancel()

    async def events(self, answer: Answer, include_usage: bool, continuous_usage: bool = False) -> AsyncIterator[str]:
        """OpenAI's stream: per choice a chunk per token (its text may be empty while a character or a possible
        stop string is incomplete, so the first chunk marks the first token) and its finish reason, each with the
        counts so far where `continuous_usage` (vLLM's continuous_usage_stats); then [usage,] [DONE]."""
        reply, count = answer.reply, len(answer.jobs)
        def counted(chunk: dict) -> dict:
            return chunk | {"usage": answer.usage()} if continuous_usage else chunk

        if reply.chat:
            for index in range(count):
                yield sse(counted(reply.chunk("", role=True, index=index)))
        offsets, finished = [0] * count, 0  # completions' text_offset of each choice's next token
        while finished < count:
            index, update = await answer.updates.get()
            if update.error:
                yield sse(ApiError(500, update.error, type="server_error").body())
                break
            calls = [c.to_openai() for c in update.tool_calls]
            ids = None if self.tokenizer else list(update.token_ids)
            chunk_logprobs = answer.logprobs(update.logprobs, offsets[index]) if answer.logprobs and update.logprobs \
                else None
            offsets[index] += sum(len(self.token_bytes(e.token).decode("utf-8", "replace")) for e in update.logprobs)
            yield sse(counted(reply.chunk(update.text, update.finish_reason, tool_calls=calls, token_ids=ids,
                                          logprobs=chunk_logprobs, index=index, reasoning=update.reasoning)))
            finished += update.finish_reason is not None
        else:
            if include_usage:
                yield sse(reply.usage_chunk(answer.usage()))
        yield SSE_DONE


@dataclass
class Answer:
    """One request's choices as they run: the jobs (prompt by prompt, n each), where their updates arrive as
    (choice index, update), the reply they go out under and how their logprobs are shaped (None: not asked)."""

    jobs: list[GenerationRequest]
    prompts: int
    updates: asyncio.Queue
    reply: Reply
    logprobs: object

    def usage(self) -> dict:
        """OpenAI's usage: each prompt counted once, every choice's tokens."""
        firsts = self.jobs[::len(self.jobs) // self.prompts]
        speculative = {key: sum(getattr(j.speculation, key) for j in self.jobs)
                       for key in ("draft_tokens", "accepted_tokens", "forward_steps")}
        return usage(sum(len(j.prompt_ids) for j in firsts), sum(len(j.generated) for j in self.jobs),
                     sum(j.cached_prompt_tokens or 0 for j in firsts), speculative)


def _deliver(loop: asyncio.AbstractEventLoop, updates: asyncio.Queue, index: int, update: Update) -> None:
    """From the engine's thread: choice `index`'s update into the handler's queue."""
    loop.call_soon_threadsafe(updates.put_nowait, (index, update))


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
    """Server-sent events that cancel their choices however the response ends (finished, disconnected, failed)."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], jobs: list[GenerationRequest]):
        super().__init__(events, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.jobs = jobs

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for job in self.jobs:
                job.cancelled = True  # a no-op once it has finished


async def _watch_disconnect(request: Request, jobs: list[GenerationRequest], updates: asyncio.Queue) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
    for job in jobs:
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
