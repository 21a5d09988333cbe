"""`persrag serve`: the HTTP face of ChatService (FastAPI; run by uvicorn). Bodies are read and checked here —
size, UTF-8, JSON, object — so every bad request is a 4xx with a one-line `error` message, never a 500, and
nothing is stored before the whole request is valid.

Endpoints: POST /v1/users (sign-up → token), POST /v1/chat/completions (OpenAI-compatible + provenance),
GET /v1/users/{id}/memories, DELETE /v1/users/{id}/memories/{mid}, POST /v1/users/{id}/history,
DELETE /v1/users/{id}, GET /healthz, GET / (the chat page).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from persrag_lightning.memory.extract import QUESTIONNAIRE
from persrag_lightning.serving.service import ChatService, ServiceError

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 1 << 20  # 1 MiB: a message is at most 8,000 characters; a history of 1,000 docs fits
PAGE = Path(__file__).with_name("static") / "chat.html"


def error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "status": status}}, status_code=status)


async def read_json(request: Request) -> dict:
    """The body as a JSON object, or a ServiceError naming what is wrong with it."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise ServiceError(413, f"body has {int(length)} bytes, more than the limit of {MAX_BODY_BYTES}")
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise ServiceError(413, f"body is larger than the limit of {MAX_BODY_BYTES} bytes")
    if not body.strip():
        raise ServiceError(400, "empty body; send a JSON object")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ServiceError(400, f"body is not valid UTF-8 (byte {e.start}: {e.reason})") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ServiceError(400, f"malformed JSON body: {e.msg} at line {e.lineno} column {e.colno}") from None
    if not isinstance(obj, dict):
        raise ServiceError(400, f"body must be a JSON object, got {type(obj).__name__}")
    return obj


def create_app(service: ChatService, model_name: str = "persrag-cfrag") -> FastAPI:
    app = FastAPI(title="persrag", description="Personalized chat: CFRAG docs + a per-user memory bank",
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = service

    @app.exception_handler(ServiceError)
    async def _service_error(_: Request, exc: ServiceError) -> JSONResponse:
        return error(exc.status, exc.message)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error(exc.status_code, str(exc.detail))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error(422, "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()))

    def caller(request: Request):
        return service.authenticate(request.headers.get("authorization"))

    @app.get("/healthz")
    def healthz() -> dict:
        return service.health()

    @app.get("/", response_class=HTMLResponse)
    def page() -> HTMLResponse:
        questions = json.dumps([{"category": q.category, "text": q.text} for q in QUESTIONNAIRE])
        return HTMLResponse(PAGE.read_text(encoding="utf-8").replace("/*QUESTIONNAIRE*/[]", questions))

    @app.post("/v1/users", status_code=201)
    async def sign_up(request: Request) -> JSONResponse:
        auth = request.headers.get("authorization")
        who = service.authenticate(auth) if auth else None
        body = await read_json(request)
        return JSONResponse(await run_in_threadpool(service.sign_up, body, who), status_code=201)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> dict:
        who = caller(request)
        body = await read_json(request)
        if body.get("stream"):
            raise ServiceError(400, "field `stream`: streaming is not supported; send stream: false")
        turn = await run_in_threadpool(service.chat, who, body)
        return service.completion(turn, str(body.get("model") or model_name), who.user_id)

    @app.get("/v1/users/{user_id}/memories")
    def memories(user_id: str, request: Request) -> dict:
        return {"user_id": user_id, "memories": service.memories(caller(request), user_id)}

    @app.delete("/v1/users/{user_id}/memories/{memory_id}", status_code=204)
    def delete_memory(user_id: str, memory_id: str, request: Request) -> Response:
        service.delete_memory(caller(request), user_id, memory_id)
        return Response(status_code=204)

    @app.post("/v1/users/{user_id}/history")
    async def history(user_id: str, request: Request) -> dict:
        who = caller(request)
        body = await read_json(request)
        return await run_in_threadpool(service.set_history, who, user_id, body)

    @app.delete("/v1/users/{user_id}")
    def delete_user(user_id: str, request: Request) -> dict:
        return service.delete_user(caller(request), user_id)

    return app
