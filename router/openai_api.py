"""The HTTP routes of the OpenAI-compatible server (FastAPI): completions and chat completions,
streamed as server-sent events or answered whole; models, health and metrics.

Every error is answered in the OpenAI format with its status: 400 naming the field, 404 for an
unknown model, 429 (admission queue full) and 503 (shutting down) with Retry-After. A streamed
request that fails after its first byte ends with an `error` event, then `[DONE]`.
"""
from __future__ import annotations

import asyncio
import contextlib
import json

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from router import openai_protocol as api
from router.openai_protocol import APIError

DISCONNECT_CHECK_S = 0.5


def _sse(data) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def build_app(frontend, metrics, model_name: str, max_model_len: int, lifespan=None) -> FastAPI:
    app = FastAPI(title="pdlab", lifespan=lifespan)
    created = api.now()

    def error(e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers())

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, e: APIError):
        if not e.admitted:
            metrics.refused(e.status)
        return error(e)

    @app.exception_handler(HTTPException)
    async def on_http_error(request: Request, e: HTTPException):   # unknown routes, wrong methods
        return error(APIError(e.status_code, f"{request.method} {request.url.path}: {e.detail}"))

    @app.get("/health")
    async def health():
        alive = {w.name: w.alive for w in frontend.router.pool.workers}
        ok = not frontend.draining and any(alive.values())
        status = "ok" if ok else ("draining" if frontend.draining else "no live worker")
        return JSONResponse({"status": status, "workers": alive}, status_code=200 if ok else 503)

    @app.get("/v1/models")
    async def models():
        return api.model_list(model_name, created, max_model_len)

    @app.get("/metrics")
    async def prometheus():
        return Response(await asyncio.to_thread(metrics.render), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await generate(request, "chat")

    async def generate(request: Request, kind: str):
        arrival = frontend.router.clock()     # TTFT and E2EL count the front end's own work too
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise APIError(400, "the request body is not valid JSON") from None
        if isinstance(body, dict) and isinstance(body.get("model"), str) and body["model"] != model_name:
            raise APIError(404, f"the model {body['model']!r} does not exist; this server serves {model_name!r}",
                           param="model", code="model_not_found")
        tok = frontend.tokenizer
        gen = api.parse_completion(body, tok, model_name) if kind == "completion" else \
            api.parse_chat(body, tok, model_name, max_model_len)
        op = frontend.admit(gen, arrival)
        if gen.stream:
            return StreamingResponse(stream(op), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Request-Id": op.rid})
        return await whole(op, request)

    async def stream(op):
        gen, first = op.gen, True
        try:
            async with contextlib.aclosing(frontend.pieces(op)) as pieces:   # closed (aborting it) if cancelled
                async for piece in pieces:
                    chunk = api.envelope(gen.kind, op.rid, model_name, created,
                                         [api.choice(gen.kind, piece.text, piece.token_ids, piece.finish_reason,
                                                     True, first)], True)
                    if gen.include_usage:
                        chunk["usage"] = api.usage(len(gen.prompt_ids), op.num_tokens) if gen.continuous_usage \
                            else None
                    first = False
                    yield _sse(chunk)
            if gen.include_usage:
                last = api.envelope(gen.kind, op.rid, model_name, created, [], True)
                last["usage"] = api.usage(len(gen.prompt_ids), op.num_tokens)
                yield _sse(last)
        except APIError as e:
            yield _sse(e.body())
        yield _sse("[DONE]")

    async def whole(op, request: Request):
        text, ids, finish = [], [], None

        async def collect():
            nonlocal finish
            async with contextlib.aclosing(frontend.pieces(op)) as pieces:
                async for piece in pieces:
                    text.append(piece.text)
                    ids.extend(piece.token_ids)
                    finish = piece.finish_reason or finish

        task = asyncio.ensure_future(collect())
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=DISCONNECT_CHECK_S)
                if not task.done() and await request.is_disconnected():
                    task.cancel()              # its request is aborted: the workers free its KV
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
                    return Response(status_code=499)   # nobody reads it: "client closed request"
            task.result()
        finally:
            task.cancel()
        gen = op.gen
        body = api.envelope(gen.kind, op.rid, model_name, created,
                            [api.choice(gen.kind, "".join(text), ids, finish, False)], False)
        body["usage"] = api.usage(len(gen.prompt_ids), op.num_tokens)
        return body

    return app
