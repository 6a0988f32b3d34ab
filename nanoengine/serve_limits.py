"""The server's door: how large a request may be, and what any refused or failed request gets back.

A request's body is read whole before anything looks at it, so its size is the first bound: a
body over ``max_request_body_bytes`` is refused (413) by its ``Content-Length`` before it is
parsed, or as soon as the bytes read pass the bound (``BodySizeLimit``; FastAPI's own limit answers
in plain text). What a request may ask for once parsed (logprobs, stop strings, prompt length) is
the engine's to bound (config.py, engine.py), checked before it is queued.

Every error leaves in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, whoever
raised it: a field that fails validation (all of them named at once), a value the engine refuses
(``param`` names the field), a body that is not JSON or not UTF-8, an unknown path or method,
a failed step (500), a dead engine (503), or a bug (500, logged with its traceback).
"""

import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from nanoengine.serve_async_engine import EngineDeadError, EngineError
from nanoengine.openai_chat_protocol import ChatCompletionRequest
from nanoengine.openai_protocol import BadRequest, CompletionRequest, error_body

# A prompt of 4,096 tokens (the default max_model_len) is some tens of KB of JSON: 4 MiB leaves room
# for long conversations and escaped text while bounding what one request makes the server hold.
MAX_REQUEST_BODY_BYTES = 4 << 20
REQUEST_FIELDS = set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields)


# A refused body is still read, and dropped, up to this many times the limit before the 413 is sent.
# Most clients (urllib, requests, the SDKs) send the whole body before they read the response, and
# a connection closed with bytes unread in it is reset, as uvicorn closes it after the response
# (at once where the client said "Connection: close", as urllib does): the client's send fails and
# it never reads the 413. Past the bound the connection is closed on the rest: a refused body costs
# the server no more than a few accepted ones.
REFUSED_BODY_DRAIN_FACTOR = 4


class BodySizeLimit:
    """ASGI middleware: a body over ``max_bytes`` is refused by its Content-Length, or, sent without
    one, once the bytes read pass it (``RequestTooLarge``, raised to the handlers below); either way
    once the rest is drained, up to ``REFUSED_BODY_DRAIN_FACTOR`` times ``max_bytes``."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes
        self.drain_bytes = REFUSED_BODY_DRAIN_FACTOR * max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            # A body past the bound is not worth reading; a client that waits for "100 Continue" sends
            # none after a 413.
            if int(length) <= self.drain_bytes and headers.get(b"expect", b"").lower() != b"100-continue":
                await self.drain(receive, 0)
            return await error_response(RequestTooLarge(self.max_bytes).detail, 413)(scope, receive, send)
        received = 0

        async def counting_receive():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                if message.get("more_body"):
                    await self.drain(receive, received)
                raise RequestTooLarge(self.max_bytes)
            return message
        await self.app(scope, counting_receive, send)

    async def drain(self, receive, received: int) -> None:
        """Read and drop the rest of a refused body (``received`` bytes of it read), up to the bound."""
        more = True
        while more and received <= self.drain_bytes:
            message = await receive()  # a disconnect ends it: it has no more_body
            received += len(message.get("body", b""))
            more = message.get("more_body", False)


class RequestTooLarge(HTTPException):  # an HTTPException, which FastAPI's body reading lets through
    def __init__(self, max_bytes: int):
        super().__init__(413, f"the request body is larger than max_request_body_bytes={max_bytes}")


def error_response(message: str, status_code: int = 400, param: str | None = None, headers=None) -> JSONResponse:
    error_type = "invalid_request_error" if status_code < 500 else "server_error"
    return JSONResponse(error_body(message, error_type, param), status_code=status_code, headers=headers)


def request_field(message: str) -> str | None:
    """The request field an engine's ``ValueError`` is about: its messages begin with the field's name."""
    name = re.match(r"\w*", message).group()
    return name if name in REQUEST_FIELDS else None


def validation_message(error: dict) -> tuple[str, str | None]:
    """One pydantic error as "field: what is wrong" (or as it is where it names the field first, as
    ``SamplingParams``' errors do), and the field."""
    loc = [str(x) for x in error["loc"] if x != "body"]
    message = str(error["ctx"]["error"]) if error["type"] == "value_error" else error["msg"]  # no "Value error, "
    field = ".".join(loc) or "body"
    return (message if message.startswith(f"{field} ") else f"{field}: {message}"), loc[0] if loc else None


def install_error_handlers(app: FastAPI, max_request_body_bytes: int) -> None:
    app.add_middleware(BodySizeLimit, max_bytes=max_request_body_bytes)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        if errors[0]["type"] == "json_invalid":
            return error_response(f"the request body is not valid JSON: {errors[0].get('ctx', {}).get('error', '')}")
        if tuple(errors[0]["loc"]) == ("body",):  # none, not an object, or not sent as JSON
            return error_response("the request body must be a JSON object, sent as Content-Type: application/json")
        messages = [validation_message(e) for e in errors]  # every bad field: one round trip fixes them all
        return error_response("; ".join(m for m, _ in messages), param=messages[0][1])

    # An unknown path (404) or method (405), a body too large (413) or not UTF-8 (400: FastAPI's
    # "There was an error parsing the body").
    @app.exception_handler(HTTPException)
    async def on_http_error(request: Request, exc: HTTPException) -> JSONResponse:
        message = exc.detail
        if exc.status_code == 400:
            message = ("the request body is not valid JSON in UTF-8, or is nested too deeply to read, or holds an "
                       "integer of over 4,300 digits")
        elif exc.status_code in (404, 405):
            message = f"{message}: {request.method} {request.url.path}"
        return error_response(message, exc.status_code, headers=exc.headers)

    @app.exception_handler(ValueError)  # BadRequest, SamplingParams' and the engine's checks
    async def on_value_error(request: Request, exc: ValueError) -> JSONResponse:
        param = exc.param if isinstance(exc, BadRequest) else request_field(str(exc))
        return error_response(str(exc), param=param)

    @app.exception_handler(EngineError)  # a failed step (500), or the engine dead (503)
    async def on_engine_error(request: Request, exc: EngineError) -> JSONResponse:
        return engine_error_response(exc)

    @app.exception_handler(Exception)  # a bug: Starlette logs its traceback after this answer
    async def on_bug(request: Request, exc: Exception) -> JSONResponse:
        return error_response(f"internal server error: {exc!r}", 500)


def engine_error_response(exc: EngineError) -> JSONResponse:
    return error_response(str(exc), 503 if isinstance(exc, EngineDeadError) else 500)
