"""The expert-load routes of a MoE server: recording (start, stop, dump to a file) and the live
EPLB rebalance, under their own names and SGLang's. A dense model has no expert to record, and a
server without EPLB placement nothing to rebalance: there the routes do not exist (404), so the
OpenAPI document lists only what the server does."""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any

from fastapi import FastAPI, Request
from pydantic import BaseModel

from moeserve.server.protocol import APIError
from moeserve.server.tokenizer_manager import TokenizerManager


class DumpRequest(BaseModel):
    path: str | None = None  # where to write the dump (default: a new file in the temp folder)


def add_expert_routes(app: FastAPI, manager: TokenizerManager, auth: list, rebalance: bool,
                      responses: dict, json_body: Any) -> None:
    """`rebalance`: EPLB placement is on (eplb.num_redundant_experts or eplb.init_placement);
    `json_body(request, model)` parses an optional body."""

    async def record(op: str) -> list:
        replies = await manager.control(op, timeout=30.0)
        bad = [r for r in replies if not r.ok]
        if bad:
            raise APIError(f"{op}: {bad[0].data.get('error', 'failed')}", status_code=409,
                           code="expert_record_failed")
        return replies

    kw = {"dependencies": auth, "responses": responses}

    @app.post("/expert_distribution/start", **kw)
    @app.post("/start_expert_distribution_record", **kw)  # SGLang's name
    async def expert_record_start() -> dict[str, Any]:
        return {"ok": True, "ranks": len(await record("expert_record_start"))}

    @app.post("/expert_distribution/stop", **kw)
    @app.post("/stop_expert_distribution_record", **kw)
    async def expert_record_stop() -> dict[str, Any]:
        return {"ok": True, "ranks": len(await record("expert_record_stop"))}

    body_doc = {"requestBody": {"required": False, "content": {
        "application/json": {"schema": DumpRequest.model_json_schema()}}}}

    @app.post("/expert_distribution/dump", openapi_extra=body_doc, **kw)
    @app.post("/dump_expert_distribution_record", openapi_extra=body_doc, **kw)
    async def expert_record_dump(request: Request) -> dict[str, Any]:
        """Sum every rank's counts into one dump file (for `python -m moeserve.eplb report`)."""
        from moeserve.eplb.recorder import merge_rank_dumps

        body = await json_body(request, DumpRequest) if await request.body() else DumpRequest()
        path = body.path or os.path.join(tempfile.gettempdir(),
                                         f"moeserve-experts-{int(time.time())}.pt")
        replies = await record("expert_record_dump")
        dump = merge_rank_dumps([r.data for r in replies], {"model": manager.model_path})
        dump.save(path)
        return {"ok": True, "path": path, "steps": dump.metadata["steps"],
                "tokens": int(dump.physical_counts.sum())}

    if not rebalance:
        return

    @app.post("/expert_distribution/rebalance", **kw)
    @app.post("/rebalance_experts", **kw)
    async def rebalance_experts() -> dict[str, Any]:
        """Live EPLB rebalance from the recorded load: all ranks move expert weights at the same
        step; requests keep running."""
        return {"ok": True, "ranks": [r.data for r in await record("rebalance")]}
