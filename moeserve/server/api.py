"""FastAPI app: OpenAI routes, the native /generate, health/info/cache/metrics routes.

Every error leaves in OpenAI's format `{"error": {"message", "type", "param", "code"}}` with a
4xx status: validation errors (including invalid JSON) are 400, not FastAPI's 422, so OpenAI clients
raise `BadRequestError`. The heavy lifting lives in serving_*.py; this file only wires routes.
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.security import HTTPBearer
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from moeserve.config import MoeserveConfig
from moeserve.server.api_experts import add_expert_routes
from moeserve.server.chat_messages import message_dict
from moeserve.server.openapi import install_openapi
from moeserve.server.protocol import (APIError, ChatCompletionRequest, ChatCompletionResponse,
                                      CompletionRequest, CompletionResponse, DetokenizeRequest,
                                      ErrorResponse, GenerateRequest, ModelCard, ModelList,
                                      TokenizeRequest, error_body)
from moeserve.server.serving_chat import chat_response, chat_stream, prepare_chat
from moeserve.server.serving_common import ClientGone, pd_of, sse_stream, until_disconnect
from moeserve.server.serving_completions import (completion_response, completion_stream,
                                                 prepare_completion)
from moeserve.server.serving_native import native_response, native_stream, prepare_native
from moeserve.server.tokenizer_manager import TokenizerManager
from moeserve.server.tool_parsers import make_parser

logger = logging.getLogger(__name__)
BEARER = HTTPBearer(auto_error=False)  # documents the scheme; _api_key_checker enforces it


def create_app(manager: TokenizerManager, cfg: MoeserveConfig) -> FastAPI:
    app = FastAPI(title="moeserve", docs_url=None, redoc_url=None)
    app.state.manager = manager
    _install_error_handlers(app)
    auth = [Depends(_api_key_checker(cfg.server.api_key))] if cfg.server.api_key else []
    _add_openai_routes(app, manager, auth)
    _add_native_routes(app, manager, cfg, auth)
    if manager.scheduler_info.get("weight_bytes", {}).get("experts"):  # a MoE model
        eplb = cfg.eplb.num_redundant_experts > 0 or cfg.eplb.init_placement is not None
        add_expert_routes(app, manager, auth, eplb, errors(409, body=True), _json_body)
    install_openapi(app, manager, cfg)
    return app


# ---- errors and auth ---------------------------------------------------------------------------
def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status_code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        errors = e.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        where = ".".join(loc)
        message = f"{where}: {first.get('msg')}" if where else str(first.get("msg"))
        if first.get("type") == "json_invalid":
            message = f"invalid JSON body: {first.get('ctx', {}).get('error', 'decode error')}"
            where = ""
        return JSONResponse(error_body(message, param=where or None), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if e.status_code < 500 else "server_error"
        return JSONResponse(error_body(str(e.detail), kind, code=e.status_code),
                            status_code=e.status_code, headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(_: Request, e: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return JSONResponse(error_body(f"internal error: {type(e).__name__}: {e}", "server_error"),
                            status_code=500)


def _api_key_checker(api_key: str) -> Callable[..., Awaitable[None]]:
    expected = api_key.encode("utf-8")

    async def check(request: Request, _: Any = Depends(BEARER)) -> None:
        """BEARER only states the scheme in /openapi.json; the header is read here."""
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        # NOTE: constant time, on bytes (compare_digest refuses non-ASCII str: a 500)
        given = token.strip().encode("utf-8", "surrogateescape")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given, expected):
            raise APIError("Incorrect API key provided." if header else
                           "Missing API key: send 'Authorization: Bearer <key>'.",
                           status_code=401, code="invalid_api_key")

    return check


# ---- response helpers --------------------------------------------------------------------------
def _stream(events: AsyncIterator[Any]) -> StreamingResponse:
    return StreamingResponse(sse_stream(events), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _complete(request: Request, work: Awaitable[Any]) -> Response:
    """Await a non-streaming result; a client that left gets nothing (its requests are aborted)."""
    try:
        result = await until_disconnect(request, work)
    except ClientGone:
        return Response(status_code=499)
    body = result.model_dump(exclude_none=False) if isinstance(result, BaseModel) else result
    return JSONResponse(body)


async def _json_body(request: Request, model: type[BaseModel]) -> Any:
    """Parse the body as JSON whatever its Content-Type (SGLang's /generate does: curl -d sends
    form encoding by default), with the same 400s as FastAPI's own parsing."""
    raw = await request.body()
    try:
        json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(f"invalid JSON body: {e}") from None
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        raise RequestValidationError(e.errors()) from None


# ---- routes ------------------------------------------------------------------------------------
def errors(*statuses: int, body: bool = False) -> dict[int | str, dict[str, Any]]:
    """Documented error responses (OpenAI's body): `statuses`, plus 400 and 413 for a route that
    reads a body, and 503 for every route (answered while the server drains)."""
    codes = set(statuses) | ({400, 413} if body else set()) | {503}
    return {code: {"model": ErrorResponse, "description": ERROR_MEANINGS[code]}
            for code in sorted(codes)}


ERROR_MEANINGS = {400: "Invalid request (see error.message and error.param)",
                  404: "The model, or the function tool_choice names, does not exist",
                  409: "Not possible in the server's current state",
                  413: "Request body over server.max_request_bytes",
                  503: "The server is shutting down or not serving"}


def _with_stream(model: type[BaseModel], *statuses: int) -> dict[int | str, dict[str, Any]]:
    """The route's JSON result, or (`stream: true`) server-sent events."""
    return {200: {"model": model, "content": {"text/event-stream": {"schema": {
        "type": "string", "description": "server-sent events, ending with data: [DONE]"}}}},
            **errors(404, *statuses, body=True)}


def _prepare(manager: TokenizerManager, prepare: Callable, req: Any, n: int) -> Any:
    """prepare(manager, req); a refusal of a PD request also ends it on the decode server."""
    try:
        return prepare(manager, req)
    except APIError as e:
        manager.refuse_rooms(pd_of(req), n, e.message)
        raise


def _add_openai_routes(app: FastAPI, manager: TokenizerManager, auth: list) -> None:
    @app.post("/v1/completions", dependencies=auth, response_model=None,
              responses=_with_stream(CompletionResponse))
    async def completions(req: CompletionRequest, request: Request) -> Response:
        job = _prepare(manager, prepare_completion, req, req.n)
        if req.stream:
            return _stream(completion_stream(manager, job))
        return await _complete(request, completion_response(manager, job))

    @app.post("/v1/chat/completions", dependencies=auth, response_model=None,
              responses=_with_stream(ChatCompletionResponse))
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
        job = _prepare(manager, prepare_chat, req, req.n)
        if req.stream:
            return _stream(chat_stream(manager, job))
        return await _complete(request, chat_response(manager, job))

    def card() -> ModelCard:
        return ModelCard(id=manager.served_model_name, root=manager.model_path,
                         max_model_len=manager.max_req_len)

    @app.get("/v1/models", dependencies=auth, responses=errors())
    async def models() -> ModelList:
        return ModelList(data=[card()])

    @app.get("/v1/models/{model:path}", dependencies=auth, responses=errors(404))
    async def model(model: str) -> ModelCard:
        if model not in (manager.served_model_name, manager.model_path):
            raise APIError(f"The model `{model}` does not exist.", status_code=404,
                           param="model", code="model_not_found")
        return card()


def _add_native_routes(app: FastAPI, manager: TokenizerManager, cfg: MoeserveConfig,
                       auth: list) -> None:
    @app.api_route("/health", methods=["GET", "HEAD"], response_model=None,
                   responses={200: {"content": {"application/json": {"schema": {
                       "type": "object", "properties": {"status": {"const": "ok"}}}}}},
                       **errors()})
    async def health() -> Response:
        if not manager.healthy:
            return JSONResponse(error_body("tokenizer manager stopped", "server_error"), 503)
        return JSONResponse({"status": "ok"})

    generate_doc = {200: {"content": {
        "application/json": {"schema": {"anyOf": [{"type": "object"}, {"type": "array"}]}},
        "text/event-stream": {"schema": {"type": "string"}}}}, **errors(body=True)}

    @app.post("/generate", dependencies=auth, response_model=None, responses=generate_doc,
              openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
                  "schema": {"$ref": "#/components/schemas/GenerateRequest"}}}}})
    async def generate(request: Request) -> Response:
        """A JSON body whatever the Content-Type (curl -d sends form encoding by default)."""
        req = await _json_body(request, GenerateRequest)
        job = _prepare(manager, prepare_native, req, req.sampling_params.n)
        if req.stream:
            return _stream(native_stream(manager, job))
        return await _complete(request, native_response(manager, job))

    @app.post("/tokenize", dependencies=auth, responses=errors(body=True))
    async def tokenize(req: TokenizeRequest) -> dict[str, Any]:
        if (req.prompt is None) == (req.messages is None):
            raise APIError("pass exactly one of prompt or messages", param="prompt")
        if req.messages is not None:
            parser = make_parser(cfg.server.tool_parser, manager.tokenizer.chat_template)
            ids = manager.apply_chat_template([message_dict(m) for m in req.messages],
                                              add_generation_prompt=req.add_generation_prompt,
                                              parser=parser)
        else:
            ids = list(manager.tokenizer(req.prompt, add_special_tokens=req.add_special_tokens)
                       ["input_ids"])
        return {"tokens": ids, "count": len(ids), "max_model_len": manager.max_req_len}

    @app.post("/detokenize", dependencies=auth, responses=errors(body=True))
    async def detokenize(req: DetokenizeRequest) -> dict[str, Any]:
        if req.tokens:
            manager.check_ids(req.tokens, "tokens")
        return {"prompt": manager.tokenizer.decode(req.tokens)}

    @app.get("/model_info", responses=errors())
    @app.get("/get_model_info", responses=errors())  # deprecated, asked for by older routers
    async def model_info() -> dict[str, Any]:
        """SGLang's route: what the served model is (sglang-router reads it per worker)."""
        return manager.model_info()

    @app.get("/server_info", responses=errors())
    async def server_info() -> dict[str, Any]:
        replies = await manager.control("server_info", timeout=10.0)
        return {"model_path": manager.model_path, "served_model_name": manager.served_model_name,
                "max_req_len": manager.max_req_len, "config": asdict(cfg),
                "ready": {f"{role}:{rank}": info for (role, rank), info in manager.ready.items()},
                "load": manager.load_summary(), "inflight": manager.num_inflight,
                "ranks": [{"rank": r.rank, "ok": r.ok, **r.data} for r in replies]}

    @app.api_route("/flush_cache", methods=["GET", "POST"], dependencies=auth,
                   responses=errors(409))
    async def flush_cache() -> dict[str, Any]:
        replies = await manager.control("flush_cache", timeout=30.0)
        if not all(r.ok for r in replies):
            raise APIError("cache not flushed: requests are still running", status_code=409,
                           code="cache_busy")
        return {"ok": True, "ranks": len(replies)}

    @app.get("/metrics", response_class=Response, responses={200: {"content": {
        "text/plain": {"schema": {"type": "string"}}}}, **errors()})
    async def metrics() -> Response:
        """Prometheus' text format."""
        return Response(manager.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)
