"""Request ids, and a line in the server's log for every error response.

A client that gets a 400 sees why in the body; whoever runs the server should see it too, in the
server's own log, and be able to match the two. So every request gets an id (the client's
``X-Request-Id`` header, or a new one), every response carries it back in ``X-Request-Id``, and
every response with a 4xx or 5xx status is logged in one line: the id, the method and path, the
status, the field at fault (OpenAI's ``param``) and the reason (its ``message``). A request whose
stream fails after its 200 has gone out is reported in the stream and logged by the engine.

An ASGI middleware, outside FastAPI's exception handlers, so it sees each error exactly as the
client does, whichever handler wrote it.
"""

import json
import logging
import uuid

logger = logging.getLogger(__name__)

MAX_LOGGED_BODY = 4096  # an error body is a short JSON object; never hold more than this of one


def reason(body: bytes) -> tuple[str | None, str]:
    """The field and the message of an error body: OpenAI's ``{"error": {...}}``, FastAPI's
    ``{"detail": ...}`` (a 404 for an unknown path), or the text itself."""
    try:
        data = json.loads(body)
    except ValueError:
        return None, body.decode("utf-8", "replace") or "(no body)"
    error = data.get("error") if isinstance(data, dict) else None
    if isinstance(error, dict):
        return error.get("param"), str(error.get("message"))
    return None, str(data.get("detail", data)) if isinstance(data, dict) else str(data)


class RequestLog:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request_id = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1") or uuid.uuid4().hex
        status, body = 0, bytearray()

        def log(status: int, param: str | None, message: str) -> None:
            logger.log(logging.ERROR if status >= 500 else logging.WARNING, "%s %s %s %d param=%s: %s",
                       request_id, scope["method"], scope["path"], status, param, message)

        async def send_with_id(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", []),
                                                  (b"x-request-id", request_id.encode("latin-1"))]}
            elif message["type"] == "http.response.body" and status >= 400:
                body.extend(message.get("body", b"")[:MAX_LOGGED_BODY - len(body)])
                if not message.get("more_body"):
                    log(status, *reason(bytes(body)))
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception as e:  # no handler took it: Starlette answers 500 and prints the traceback
            log(500, None, repr(e))
            raise
