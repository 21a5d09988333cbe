"""`persrag serve`: the HTTP face of ChatService (FastAPI; run by uvicorn). Bodies are read and
checked here — Content-Type, size, UTF-8, JSON (nesting depth, integer size), object — then parsed
by the service with the body's pydantic model (serving/requests.py), so every bad request is a 4xx
with a one-line `error` message, never a 500, and nothing is stored before the whole request is
valid. The raw checks come first, and the caller's token before them, which FastAPI's own body
parameters would not keep. Around every request: the Host header checked against the bind address
(DNS rebinding), per-client rate limits, and security headers (a CSP that admits exactly the page's
own inline script and style, no framing, no sniffing, no caching).

Endpoints: POST /v1/users (sign-up → token), POST /v1/chat/completions (OpenAI-compatible +
provenance), POST /v1/answers (a question of the run's task, answered by its reader), GET
/v1/users/{id}/memories, DELETE /v1/users/{id}/memories/{mid}, POST
/v1/users/{id}/history, DELETE /v1/users/{id}, GET /healthz, GET / (the chat page). `app.openapi()`
describes every body with the schemas of those models (the schema the fuzzing tests generate
requests from); it is not served.
"""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import json
import logging
import re
from collections.abc import Callable, Sequence
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException

from persrag_lightning.memory.extract import QUESTIONNAIRE
from persrag_lightning.serving.accounts import Caller
from persrag_lightning.serving.answers import answer_question
from persrag_lightning.serving.limits import Limits, RateLimiter
from persrag_lightning.serving.requests import Chat, Error, History, Question, SignUp
from persrag_lightning.serving.service import ChatService
from persrag_lightning.serving.validation import ServiceError

__all__ = ["allowed_hosts_for", "create_app"]

log = logging.getLogger(__name__)

# 1 MiB: a message is at most 8,000 characters; a history of MAX_HISTORY_DOCS docs fits
MAX_BODY_BYTES = 1 << 20
PAGE = Path(__file__).with_name("static") / "chat.html"
JSON_TYPES = ("application/json",)
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")
API_HEADERS = {
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
    "Content-Security-Policy": "default-src 'none'; frame-ancestors 'none'",
}


def error(status: int, message: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "status": status}}, status_code=status, headers=headers
    )


async def read_json(request: Request) -> dict:
    """The body as a JSON object, or a ServiceError naming what is wrong with it."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype not in JSON_TYPES:
        # a cross-site form or text/plain POST needs no preflight: refusing it is what keeps a page
        # elsewhere from signing users up (or chatting) through a visitor's browser
        raise ServiceError(415, f"Content-Type must be application/json, got {ctype or 'none'!r}")
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise ServiceError(
            413, f"body has {int(length)} bytes, more than the limit of {MAX_BODY_BYTES}"
        )
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
        raise ServiceError(
            400, f"malformed JSON body: {e.msg} at line {e.lineno} column {e.colno}"
        ) from None
    except RecursionError:
        raise ServiceError(400, "malformed JSON body: nested too deeply") from None
    except ValueError as e:  # an integer of more than 4,300 digits (int_max_str_digits)
        raise ServiceError(
            400, f"malformed JSON body: a number with too many digits ({e})"
        ) from None
    if not isinstance(obj, dict):
        raise ServiceError(400, f"body must be a JSON object, got {type(obj).__name__}")
    return obj


def allowed_hosts_for(bind_host: str, configured: Sequence[str] | None = None) -> list[str] | None:
    """The Host header values a server bound to `bind_host` answers: the configured names, else the
    bind address (with the loopback names when it is loopback); None (any) for a wildcard bind
    without configured names."""
    if configured:
        return list(configured)
    host = bind_host.strip("[]")
    if host in ("", "0.0.0.0", "::"):
        return None
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    return list(dict.fromkeys([host, *LOOPBACK_NAMES])) if loopback else [host]


def _host_name(header: str) -> str:
    """`example.org:8000` → `example.org`, `[::1]:8000` → `::1`."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].split("]", 1)[0]
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def _page_and_csp() -> tuple[str, str]:
    """The chat page with its questionnaire, and a CSP admitting exactly its inline script and style
    by hash."""
    questions = json.dumps([{"category": q.category, "text": q.text} for q in QUESTIONNAIRE])
    html = PAGE.read_text(encoding="utf-8").replace("/*QUESTIONNAIRE*/[]", questions)

    def hashes(tag: str) -> str:
        bodies = re.findall(rf"<{tag}>(.*?)</{tag}>", html, re.DOTALL)
        return " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(b.encode()).digest()).decode()}'"
                        for b in bodies)

    csp = (f"default-src 'none'; script-src {hashes('script')}; style-src {hashes('style')}; connect-src 'self'; "
           "img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
    return html, csp


# ---- the OpenAPI description of the bodies: generated from their models (serving/requests.py) ----

BODIES = (SignUp, Chat, Question, History)
REFUSALS = (400, 401, 403, 404, 409, 413, 415, 422, 429)


def body_schemas() -> dict:
    """The request bodies' JSON schemas (and those they nest), as OpenAPI components."""
    _, top = models_json_schema([(m, "validation") for m in (*BODIES, Error)],
                                ref_template="#/components/schemas/{model}")
    return top["$defs"]


def _body(model: type[BaseModel]) -> dict:
    """A path operation's body and refusals; the body is read by hand (read_json), then parsed with
    `model`."""
    errors = {str(s): {"description": "refused", "content": {"application/json": {
        "schema": {"$ref": "#/components/schemas/Error"}}}} for s in REFUSALS}
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}, "responses": errors}


def create_app(service: ChatService, model_name: str = "persrag-cfrag", limits: Limits | None = None,
               allowed_hosts: Sequence[str] | None = None) -> FastAPI:
    """`limits`: per-client rate limits (default Limits()); `allowed_hosts`: the Host names answered
    (None: any; `persrag serve` passes allowed_hosts_for(--host, --allowed_host))."""
    app = FastAPI(title="persrag", description="Personalized chat: CFRAG docs + a per-user memory bank",
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = service
    app.openapi = lambda: openapi_schema(app)
    _add_guard(app, limits or Limits(), allowed_hosts)
    _add_error_handlers(app)
    _add_routes(app, service, model_name)
    return app


def openapi_schema(app: FastAPI) -> dict:
    """FastAPI's description of the routes, with the bodies' schemas (body_schemas) and the bearer
    scheme."""
    if app.openapi_schema is None:
        schema = FastAPI.openapi(app)
        schema.setdefault("components", {}).setdefault("schemas", {}).update(body_schemas())
        schema["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        app.openapi_schema = schema
    return app.openapi_schema


def _add_guard(app: FastAPI, limits: Limits, allowed_hosts: Sequence[str] | None) -> None:
    """Around every request: the Host header, the rate limits (a sign-up counts once it created an
    account) and the security headers."""
    signups = RateLimiter(limits.signup_per_minute, limits.max_clients)
    requests_ = RateLimiter(limits.requests_per_minute, limits.max_clients)
    hosts = {h.lower().strip("[]") for h in allowed_hosts} if allowed_hosts is not None else None

    @app.middleware("http")
    async def guard(request: Request, call_next):
        if hosts is not None and _host_name(request.headers.get("host", "")) not in hosts:
            response = error(400, "unexpected Host header; this server answers "
                                  f"{', '.join(sorted(hosts))} (persrag serve --allowed_host)")
        else:
            client = request.client.host if request.client else "unknown"
            signing_up = request.method == "POST" and request.url.path == "/v1/users"
            wait = requests_.take(client) or (
                signups.take(client, spend=False) if signing_up else 0
            )
            if wait:
                response = error(429, f"rate limit of this client reached; retry after {wait} s",
                                 {"Retry-After": str(wait)})
            else:
                response = await call_next(request)
                if signing_up and response.status_code == 201:
                    signups.take(client)  # an account was created: it counts
        for key, value in API_HEADERS.items():
            response.headers.setdefault(key, value)
        return response


def _add_error_handlers(app: FastAPI) -> None:
    """Every refusal in one shape, `{"error": {"message", "status"}}`: the service's, Starlette's
    (404, 405) and FastAPI's own validation (of nothing the routes declare today)."""

    @app.exception_handler(ServiceError)
    async def _service_error(_: Request, exc: ServiceError) -> JSONResponse:
        return error(exc.status, exc.message)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error(exc.status_code, str(exc.detail))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error(
            422, "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        )


def _add_routes(app: FastAPI, service: ChatService, model_name: str) -> None:
    """The endpoints: the token first, then the body (read_json), then the service in a worker
    thread."""

    def caller(request: Request) -> Caller:
        return service.authenticate(request.headers.get("authorization"))

    _add_page_routes(app, service)
    _add_conversation_routes(app, service, model_name, caller)
    _add_user_data_routes(app, service, caller)


def _add_page_routes(app: FastAPI, service: ChatService) -> None:
    """The health check and the chat page, which need no token."""
    page_html, page_csp = _page_and_csp()

    @app.get("/healthz")
    def healthz() -> dict:
        return service.health()

    @app.get("/", response_class=HTMLResponse)
    def page() -> HTMLResponse:
        return HTMLResponse(page_html, headers={"Content-Security-Policy": page_csp})


def _add_conversation_routes(app: FastAPI, service: ChatService, model_name: str,
                             caller: Callable[[Request], Caller]) -> None:
    """Signing up, chatting and asking label questions."""

    @app.post("/v1/users", status_code=201, openapi_extra=_body(SignUp))
    async def sign_up(request: Request) -> JSONResponse:
        auth = request.headers.get("authorization")
        who = service.authenticate(auth) if auth else None
        body = await read_json(request)
        return JSONResponse(await run_in_threadpool(service.sign_up, body, who), status_code=201)

    @app.post("/v1/chat/completions", openapi_extra=_body(Chat))
    async def chat(request: Request) -> dict:
        who = caller(request)
        body = await read_json(request)
        turn = await run_in_threadpool(service.chat, who, body)
        return service.completion(turn, turn.model or model_name, who.user_id)

    @app.post("/v1/answers", openapi_extra=_body(Question))
    async def answers(request: Request) -> dict:
        who = caller(request)
        body = await read_json(request)
        return await run_in_threadpool(answer_question, service, who, body)


def _add_user_data_routes(app: FastAPI, service: ChatService, caller: Callable[[Request], Caller]) -> None:
    """A user's memories, history and account: listed, set and deleted."""

    @app.get("/v1/users/{user_id}/memories")
    def memories(user_id: str, request: Request) -> dict:
        return {"user_id": user_id, "memories": service.memories(caller(request), user_id)}

    @app.delete("/v1/users/{user_id}/memories/{memory_id}", status_code=204)
    def delete_memory(user_id: str, memory_id: str, request: Request) -> Response:
        service.delete_memory(caller(request), user_id, memory_id)
        return Response(status_code=204)

    @app.post("/v1/users/{user_id}/history", openapi_extra=_body(History))
    async def history(user_id: str, request: Request) -> dict:
        who = caller(request)
        body = await read_json(request)
        return await run_in_threadpool(service.set_history, who, user_id, body)

    @app.delete("/v1/users/{user_id}")
    def delete_user(user_id: str, request: Request) -> dict:
        return service.delete_user(caller(request), user_id)
