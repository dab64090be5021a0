"""FastAPI app: OpenAI routes, the native /generate, health/info/cache/metrics routes.

Every error leaves in OpenAI's format `{"error": {"message", "type", "param", "code"}}` with a
4xx status: validation errors (including invalid JSON) are 400, not FastAPI's 422, so OpenAI clients
raise `BadRequestError`. The heavy lifting lives in serving_*.py; this file only wires routes.
"""

from __future__ import annotations

import json
import logging
import os
import hmac
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from moeserve.config import MoeserveConfig
from moeserve.server.protocol import (APIError, ChatCompletionRequest, CompletionRequest,
                                      DetokenizeRequest, GenerateRequest, ModelCard, ModelList,
                                      TokenizeRequest, error_body)
from moeserve.server.chat_messages import message_dict
from moeserve.server.serving_chat import chat_response, chat_stream, prepare_chat
from moeserve.server.tool_parsers import make_parser
from moeserve.server.serving_common import ClientGone, sse_stream, until_disconnect
from moeserve.server.serving_completions import (completion_response, completion_stream,
                                                 prepare_completion)
from moeserve.server.serving_native import native_response, native_stream, prepare_native
from moeserve.server.tokenizer_manager import TokenizerManager

logger = logging.getLogger(__name__)


def create_app(manager: TokenizerManager, cfg: MoeserveConfig) -> FastAPI:
    app = FastAPI(title="moeserve", docs_url=None, redoc_url=None)
    app.state.manager = manager
    _install_error_handlers(app)
    auth = [Depends(_api_key_checker(cfg.server.api_key))]
    _add_openai_routes(app, manager, auth)
    _add_native_routes(app, manager, cfg, auth)
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


def _api_key_checker(api_key: str | None) -> Callable[[Request], Awaitable[None]]:
    expected = (api_key or "").encode("utf-8")

    async def check(request: Request) -> None:
        if api_key is None:
            return
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
    try:
        data = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(f"invalid JSON body: {e}") from None
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise RequestValidationError(e.errors()) from None


# ---- routes ------------------------------------------------------------------------------------
def _add_openai_routes(app: FastAPI, manager: TokenizerManager, auth: list) -> None:
    @app.post("/v1/completions", dependencies=auth)
    async def completions(req: CompletionRequest, request: Request) -> Response:
        job = prepare_completion(manager, req)
        if req.stream:
            return _stream(completion_stream(manager, job))
        return await _complete(request, completion_response(manager, job))

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
        job = prepare_chat(manager, req)
        if req.stream:
            return _stream(chat_stream(manager, job))
        return await _complete(request, chat_response(manager, job))

    def card() -> ModelCard:
        return ModelCard(id=manager.served_model_name, root=manager.model_path,
                         max_model_len=manager.max_req_len)

    @app.get("/v1/models", dependencies=auth)
    async def models() -> ModelList:
        return ModelList(data=[card()])

    @app.get("/v1/models/{model:path}", dependencies=auth)
    async def model(model: str) -> ModelCard:
        if model not in (manager.served_model_name, manager.model_path):
            raise APIError(f"The model `{model}` does not exist.", status_code=404,
                           param="model", code="model_not_found")
        return card()


def _add_native_routes(app: FastAPI, manager: TokenizerManager, cfg: MoeserveConfig,
                       auth: list) -> None:
    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        if not manager.healthy:
            return JSONResponse(error_body("tokenizer manager stopped", "server_error"), 503)
        return JSONResponse({"status": "ok"})

    @app.post("/generate", dependencies=auth)
    async def generate(request: Request) -> Response:
        req = await _json_body(request, GenerateRequest)
        job = prepare_native(manager, req)
        if req.stream:
            return _stream(native_stream(manager, job))
        return await _complete(request, native_response(manager, job))

    @app.post("/tokenize", dependencies=auth)
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

    @app.post("/detokenize", dependencies=auth)
    async def detokenize(req: DetokenizeRequest) -> dict[str, Any]:
        if req.tokens:
            manager.check_ids(req.tokens, "tokens")
        return {"prompt": manager.tokenizer.decode(req.tokens)}

    @app.get("/model_info")
    @app.get("/get_model_info")  # the deprecated name, still asked for by older routers
    async def model_info() -> dict[str, Any]:
        """SGLang's route: what the served model is (sglang-router reads it per worker)."""
        return manager.model_info()

    @app.get("/server_info")
    async def server_info() -> dict[str, Any]:
        replies = await manager.control("server_info", timeout=10.0)
        return {"model_path": manager.model_path, "served_model_name": manager.served_model_name,
                "max_req_len": manager.max_req_len, "config": asdict(cfg),
                "ready": {f"{role}:{rank}": info for (role, rank), info in manager.ready.items()},
                "load": manager.load_summary(), "inflight": manager.num_inflight,
                "ranks": [{"rank": r.rank, "ok": r.ok, **r.data} for r in replies]}

    @app.api_route("/flush_cache", methods=["GET", "POST"], dependencies=auth)
    async def flush_cache() -> Response:
        replies = await manager.control("flush_cache", timeout=30.0)
        if not all(r.ok for r in replies):
            raise APIError("cache not flushed: requests are still running", status_code=400,
                           code="cache_busy")
        return JSONResponse({"ok": True, "ranks": len(replies)})

    async def expert_record(op: str) -> dict[str, Any]:
        replies = await manager.control(op, timeout=30.0)
        bad = [r for r in replies if not r.ok]
        if bad:
            raise APIError(f"{op}: {bad[0].data.get('error', 'failed')}", status_code=400)
        return {"ok": True, "ranks": len(replies), "replies": replies}

    @app.post("/expert_distribution/start", dependencies=auth)
    @app.post("/start_expert_distribution_record", dependencies=auth)  # SGLang's name
    async def expert_record_start() -> dict[str, Any]:
        return {"ok": True, "ranks": (await expert_record("expert_record_start"))["ranks"]}

    @app.post("/expert_distribution/stop", dependencies=auth)
    @app.post("/stop_expert_distribution_record", dependencies=auth)
    async def expert_record_stop() -> dict[str, Any]:
        return {"ok": True, "ranks": (await expert_record("expert_record_stop"))["ranks"]}

    @app.post("/expert_distribution/dump", dependencies=auth)
    @app.post("/dump_expert_distribution_record", dependencies=auth)
    async def expert_record_dump(request: Request) -> dict[str, Any]:
        """Sum every rank's counts into one dump file (for `python -m moeserve.eplb report`)."""
        from moeserve.eplb.recorder import merge_rank_dumps

        body = await request.json() if await request.body() else {}
        path = body.get("path") if isinstance(body, dict) else None
        path = path or os.path.join(tempfile.gettempdir(),
                                    f"moeserve-experts-{int(time.time())}.pt")
        replies = (await expert_record("expert_record_dump"))["replies"]
        dump = merge_rank_dumps([r.data for r in replies], {"model": manager.model_path})
        dump.save(path)
        return {"ok": True, "path": path, "steps": dump.metadata["steps"],
                "tokens": int(dump.physical_counts.sum())}

    @app.post("/expert_distribution/rebalance", dependencies=auth)
    @app.post("/rebalance_experts", dependencies=auth)
    async def rebalance_experts() -> dict[str, Any]:
        """Live EPLB rebalance from the recorded load: all ranks move expert weights at the same
        step; requests keep running."""
        replies = (await expert_record("rebalance"))["replies"]
        return {"ok": True, "ranks": [r.data for r in replies]}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(manager.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)
