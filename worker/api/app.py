"""The worker's HTTP app (Litestar): the four agent APIs, tokenizer helpers, health and metrics.

Model names: one model is served, so any `model` value is accepted on the generation endpoints
(Claude Code sends names like "claude-sonnet-4-5", Codex "gpt-5-codex"); responses name the
served model. GET /v1/models lists it; GET /v1/models/{id} answers 404 unless `id` is the served
name or the GGUF file name (with or without `.gguf`).

Who may call (security.py): the Host and Origin checks against pages in the user's browser, JSON
bodies only, and with an API key set every endpoint except /health/live, /health/ready and /health (and
/metrics and /v1/stats unless --metrics-auth) wants it, as `Authorization: Bearer KEY` or
`x-api-key: KEY`. Bodies past what the context can use are refused before they are read (413,
limits.py); large ones are decoded off the event loop.

Errors come in the protocol's own shape: Anthropic's for /v1/messages* (and any request carrying
an `anthropic-version` header), OpenAI's otherwise. Never a traceback: unexpected exceptions are
logged (JSON line with the traceback) and answered with a generic 500. A client that goes away while
its body arrives is no fault of ours: one `client_gone` info line, no traceback (readguard.py, the
server's read timeouts, logs the ones it closed for slowness itself).
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any, cast

import msgspec
from litestar import Litestar, Request, Response, get, post
from litestar.background_tasks import BackgroundTask
from litestar.config.cors import CORSConfig
from litestar.exceptions import HTTPException
from litestar.handlers import HTTPRouteHandler
from litestar.params import FromPath
from litestar.response import Stream
from litestar.types import HTTPReceiveMessage

from ..logs import log
from ..text.formats import resolve as resolve_formats
from . import anthropic_messages, common, kv_lookup, openapi, tokenize
from .adapter import ProtocolAdapter, Submitted
from .common import ApiContext
from .errors import ApiError, anthropic_error, openai_error
from .limits import RequestLimits, too_large
from .readguard import SCOPE_KEY
from .routes import ROUTES
from .security import LOOPBACK_ORIGIN, Guard
from .sse import SSE_HEADERS, stream
from .state import ServerState

JSON = "application/json"
USER_AGENT_CHARS = 200  # of a client's User-Agent the admit line keeps

_encoder = msgspec.json.Encoder()


def _is_anthropic(request: Request) -> bool:
    return request.url.path.startswith("/v1/messages") or "anthropic-version" in request.headers


def error_response(request: Request, e: ApiError) -> Response:
    body = anthropic_error(e) if _is_anthropic(request) else openai_error(e)
    return Response(_encoder.encode(body), status_code=e.status, media_type=JSON, headers=e.headers())


class ClientGone(Exception):
    """The client went away before its request body was all there."""

    def __init__(self, received: int, declared: str):
        super().__init__(f"the client went away after {received} bytes of the body")
        self.received, self.declared = received, declared


def _json(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(_encoder.encode(obj), status_code=status, media_type=JSON, headers=headers)


# -- models, tokenizer helpers ---------------------------------------------------------------------------------


class ModelCard(msgspec.Struct):
    id: str
    created: int
    created_at: str
    display_name: str
    context_length: int
    object: str = "model"
    type: str = "model"
    owned_by: str = "ember"


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    first_id: str | None
    last_id: str | None
    object: str = "list"
    has_more: bool = False


def create_app(engine: Any, model: Any, *, api_key: str | None, model_name: str, state: ServerState,
               keepalive_seconds: float = 2.0, limits: RequestLimits | None = None, guard: Guard | None = None,
               log_prompts: bool = False, version: str = "unknown") -> Litestar:
    """The Litestar app over `engine` (started by the caller). `engine` and `model` may be None while
    loading; `state.attach(engine, model, formats)` supplies them later (generation answers 503
    meanwhile). guard: who may call (default: loopback only, no key beyond `api_key`)."""
    if engine is not None or model is not None:
        state.attach(engine, model, resolve_formats(model.template, model.tokenizer) if model is not None else None)
    guard = guard or Guard(api_key=api_key or None)
    ctx = ApiContext(state=state, api_key=guard.api_key, model_name=model_name, keepalive_seconds=keepalive_seconds,
                     limits=limits or RequestLimits(), log_prompts=log_prompts)
    return Litestar(
        route_handlers=[*_generation_routes(ctx), *_model_routes(ctx), *_helper_routes(ctx, version),
                        *_health_routes(ctx, {"public": not guard.metrics_auth})],
        before_request=_caller_check(guard),
        exception_handlers={ApiError: _on_api_error, ClientGone: _on_client_gone, HTTPException: _on_http_error,
                            Exception: _on_error},
        request_max_body_size=None,  # read_body applies the context's limit
        cors_config=_cors(guard),
        openapi_config=None,
        logging_config=None,
        debug=False,
    )


# -- plumbing ---------------------------------------------------------------------------------------------------


def _caller_check(guard: Guard) -> Callable[[Request], Awaitable[Response | None]]:
    async def check_caller(request: Request) -> Response | None:
        """Host, Origin, Content-Type, then the key: refused before any work, in the protocol's shape."""
        try:
            guard.check_host(request.headers.get("host"))
            guard.check_origin(request.headers.get("origin"))
            guard.check_content_type(request.method, request.headers.get("content-type"))
            guard.check_key(request.headers, bool(request.route_handler.opt.get("public")))
        except ApiError as e:
            return error_response(request, e)
        return None

    return check_caller


def _cors(guard: Guard) -> CORSConfig:
    """CORS for the origins the guard lets in; preflights from any other origin get no CORS headers."""
    return CORSConfig(allow_origins=["*"] if guard.any_origin else list(guard.allowed_origins),
                      allow_origin_regex=None if guard.any_origin else LOOPBACK_ORIGIN,
                      allow_methods=["GET", "POST", "OPTIONS"],
                      allow_headers=["authorization", "x-api-key", "content-type", "anthropic-version",
                                     "anthropic-beta", "openai-beta"],
                      expose_headers=["x-request-id", "request-id", "retry-after"])


def _on_api_error(request: Request, e: ApiError) -> Response:
    return error_response(request, e)


def _on_http_error(request: Request, e: HTTPException) -> Response:
    status = e.status_code
    if status >= 500:  # Litestar's own 5xx: log it like any other fault
        return _on_error(request, e)
    message = {404: f"no such endpoint: {request.method} {request.url.path}",
               405: f"method {request.method} is not allowed on {request.url.path}",
               413: "the request body is too large"}.get(status, str(e.detail))
    return error_response(request, ApiError(status, message))


def _on_error(request: Request, e: Exception) -> Response:
    log("api_error", level="error", path=request.url.path, error=f"{type(e).__name__}: {e}",
        traceback=traceback.format_exc())
    return error_response(request, ApiError(500, f"internal error: {type(e).__name__}"))


def _on_client_gone(request: Request, e: ClientGone) -> Response:
    if SCOPE_KEY not in request.scope:  # (one it timed out, readguard has logged)
        log("client_gone", path=request.url.path, phase="body", body_bytes=e.received,
            content_length=int(e.declared) if e.declared.isdigit() else None)
    return Response(b"", status_code=499)  # nobody reads it: the connection is gone


async def _body_of(ctx: ApiContext, request: Request, type_: type) -> Any:
    return await common.decode_body_async(await _read_body(request, ctx.body_limit()), type_, ctx.limits)


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused (413) as soon as it is known to be past `limit` (what the context can use):
    from Content-Length before reading, else while it streams in. The ASGI messages are read
    here rather than through request.stream(), whose disconnect is a 500 with a traceback."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large(limit)
    chunks, size = [], 0
    while True:
        # an HTTP request receives HTTP messages only (Request.receive is typed for websockets too,
        # and Litestar's own request.stream() casts it the same way)
        message = cast("HTTPReceiveMessage", await request.receive())
        if message["type"] == "http.disconnect":
            raise ClientGone(size, declared)
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _sse(ctx: ApiContext, handle, renderer, headers: dict[str, str]) -> Stream:
    # The background task runs once the body is done, also when a disconnect cancelled the stream
    # before it began: cancelling a settled request is a no-op, an unsettled one stops at once.
    return Stream(stream(handle, renderer, ctx.keepalive_seconds), media_type="text/event-stream",
                  headers={**SSE_HEADERS, **headers}, background=BackgroundTask(handle.cancel))


def _need_model(ctx: ApiContext) -> None:
    if ctx.model is None:
        raise ApiError(503, "the model is still loading; retry shortly", code="service_unavailable",
                       retry_after=common.RETRY_AFTER_UNAVAILABLE)


# -- generation endpoints: one handler over the route table ------------------------------------------------------


def _generation_routes(ctx: ApiContext) -> list[HTTPRouteHandler]:
    @post("/v1/messages/count_tokens", status_code=200)
    async def count_tokens(request: Request) -> Response:
        body = await _body_of(ctx, request, anthropic_messages.MessagesRequest)
        _need_model(ctx)
        prompt = await anthropic_messages.prompt_of(ctx, body)
        return _json(anthropic_messages.CountTokensResponse(len(prompt)))

    return [*(_generation_route(ctx, a) for a in ROUTES), count_tokens]


def _generation_route(ctx: ApiContext, adapter: ProtocolAdapter) -> HTTPRouteHandler:
    async def generate(request: Request) -> Response:
        rid = common.new_id(adapter.id_prefix)
        try:  # until the engine has it, whatever ends the request is its one outcome line
            body = await _body_of(ctx, request, adapter.body_type)
            common.check_accepting(ctx)
            req, notes = await adapter.to_generation(ctx, body, rid)
            if adapter.reads_probe:
                req.probe = request.headers.get("x-ember-probe") == "1"  # the daemon's readiness probe
            req.user_agent = request.headers.get("user-agent", "")[:USER_AGENT_CHARS]  # for the admit line
            handle = common.submit(ctx, req, adapter.prompt_param)
        except ApiError as e:
            raise common.refuse(ctx, rid, adapter.protocol, e) from None
        except ClientGone:
            raise  # (a client_gone line)
        except Exception as e:
            common.fail_early(ctx, rid, adapter.protocol, e)
            raise
        submitted = Submitted(ctx, body, rid, common.now(), req, notes)
        headers = adapter.headers(rid)
        if body.stream:
            return _sse(ctx, handle, adapter.renderer(submitted), headers)
        result = await common.collect(request.receive, handle)
        return _json(adapter.response(submitted, result), headers=headers)

    return post(adapter.path, status_code=200, name=adapter.protocol)(generate)


# -- models ------------------------------------------------------------------------------------------------------


def _model_routes(ctx: ApiContext) -> list[HTTPRouteHandler]:
    created_unix = int(time.time())

    def card() -> ModelCard:
        stamp = datetime.fromtimestamp(created_unix, UTC).isoformat().replace("+00:00", "Z")
        context = ctx.engine.limits.context if ctx.engine is not None else 0
        return ModelCard(ctx.model_name, created_unix, stamp, ctx.model_name, context)

    @get("/v1/models")
    async def list_models() -> Response:
        c = card()
        return _json(ModelList([c], c.id, c.id))

    @get("/v1/models/{model_id:path}")
    async def get_model(model_id: FromPath[str]) -> Response:
        model_id = model_id.lstrip("/")
        if model_id not in ctx.served_names():
            raise ApiError(404, f"the model {model_id!r} does not exist; this worker serves {ctx.model_name!r}",
                           param="model", code="model_not_found")
        return _json(card())

    return [list_models, get_model]


# -- tokenizer helpers, the OpenAPI document ---------------------------------------------------------------------


def _helper_routes(ctx: ApiContext, version: str) -> list[HTTPRouteHandler]:
    @post("/tokenize", status_code=200)
    async def tokenize_text(request: Request) -> Response:
        body = await _body_of(ctx, request, tokenize.TokenizeRequest)
        _need_model(ctx)
        return _json(await tokenize.tokenize(ctx, body))

    @post("/detokenize", status_code=200)
    async def detokenize_ids(request: Request) -> Response:
        body = await _body_of(ctx, request, tokenize.DetokenizeRequest)
        _need_model(ctx)
        return _json(await tokenize.detokenize(ctx, body))

    @post("/v1/kv/lookup", status_code=200)
    async def kv_lookup_tokens(request: Request) -> Response:
        body = await _body_of(ctx, request, kv_lookup.LookupRequest)
        _need_model(ctx)
        return _json(await kv_lookup.lookup(ctx, body))

    @get("/openapi.json")
    async def openapi_document() -> Response:
        return _json(openapi.document(version))

    return [tokenize_text, detokenize_ids, kv_lookup_tokens, openapi_document]


# -- health, metrics, stats (public; never the engine lock) ------------------------------------------------------


def _health_routes(ctx: ApiContext, metrics_opt: dict[str, Any]) -> list[HTTPRouteHandler]:
    state = ctx.state

    @get("/health/live", opt={"public": True})
    async def live() -> Response:
        return _json(state.describe(), 200 if state.live_ok() else 503)

    # /health: the readiness answer under the path routers and load balancers ask by default
    # (sglang-router, Kubernetes examples, llama-server and vLLM clients)
    @get(["/health/ready", "/health"], opt={"public": True})
    async def ready() -> Response:
        ok = state.ready_ok()
        return _json(state.describe(), 200 if ok else 503,
                     headers=None if ok else {"Retry-After": str(common.RETRY_AFTER_UNAVAILABLE)})

    @get("/metrics", opt=metrics_opt)
    async def metrics() -> Response:
        text = ctx.engine.metrics.prometheus_text() if ctx.engine is not None else b""
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @get("/v1/stats", opt=metrics_opt)
    async def stats() -> Response:
        """What the engine published (engine/stats.py), beside the limits it was built with."""
        out: dict[str, Any] = {"state": state.state, "model": ctx.model_name}
        engine = ctx.engine
        if engine is not None:
            lim, st = engine.limits, engine.stats
            out["engine"] = {
                "backend": engine.backend.name, "fingerprint": str(engine.model.fingerprint),
                "max_seqs": lim.max_seqs, "max_queue": lim.max_queue, "context": lim.context,
                "prefill_chunk": lim.prefill_chunk, "max_step_tokens": lim.max_step_tokens,
                "block_size": engine.backend.block_size, "kv_blocks": st.kv_blocks,
                "running": st.running, "waiting": st.waiting, "steps": st.steps,
                "last_progress_seconds": round(time.monotonic() - st.last_progress, 3),
            }
            out["metrics"] = engine.metrics.snapshot()
        out["kv_persistence"] = state.kv_persistence()
        return _json(out)

    return [live, ready, metrics, stats]
