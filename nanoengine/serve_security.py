"""Who may use the server, from which web pages, over what, and how many requests at once: what it
takes to run the server for others (serve.py installs it; the flags are serve_cli_args.py's "access" group).

The default is the one-person case: bound to 127.0.0.1, no key, answering browsers only on local
pages. Each step past it is one option:

- ``api_keys`` (``--api-key``): every route but an explicit list of open ones (``/health``,
  ``/ping``, ``/version`` and, unless ``metrics_require_api_key``, ``/metrics``) needs
  ``Authorization: Bearer <key>``, as vLLM's and llama.cpp's servers do and the openai SDK sends.
  The check covers paths, not routes, so a route added later is behind the key unless it is
  listed as open. A missing or wrong key is a 401 in OpenAI's shape; the key is never logged.
- origins (``--allowed-origins``...): which web pages a browser lets read the answers (CORS). By
  default only pages served from the machine itself (localhost, 127.0.0.1, [::1], any port), as
  Ollama allows: with ``*``, any page a user opens could drive their local server.
- ``max_queued_requests``: how many POSTs under ``/v1/`` (the routes that queue work on the
  engine) may be in flight at once, counted from the moment the request's headers arrive to the
  moment its response (a stream included) ends, whatever it is doing meanwhile (tokenizing,
  waiting, running, sending). Past the bound a request is refused (503, ``Retry-After``) before its
  body is read, so it costs nothing and changes nothing for the requests in flight.
- TLS (``--ssl-certfile``...) is uvicorn's; ``tls_options`` checks the files before the model loads.

The three run in this order (Starlette runs the middleware added last first): CORS (a preflight is
answered before any key is asked for, and a 401 carries CORS headers so that an allowed page can
read it), then the key, then the bound (a client without the key takes no seat); all of them
inside serve_request_log.py's, which logs their refusals, and before anything reads the body.
"""

import argparse
import hashlib
import hmac
import ipaddress
import logging
import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from prometheus_client import Counter

from nanoengine.serve_limits import error_response
from nanoengine.openai_protocol import error_body

logger = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health", "/ping", "/version"})  # a load balancer's probes: they reveal nothing
API_KEY_ENV = ("NANOENGINE_API_KEY", "VLLM_API_KEY")  # read in this order when no --api-key is given
# http or https, any port or none: the pages a browser loads from this machine.
LOCAL_ORIGINS = r"https?://(localhost|127\.0\.0\.1|\[::1\])(:\d+)?"
RETRY_AFTER_SECONDS = 1  # a refused request asks again soon: the bound is about a burst, not an outage


@dataclass
class AccessOptions:
    """Who may use the server and how many requests may be in flight; the default serves one person."""

    api_keys: list[str] = field(default_factory=list)  # empty: no key is asked for
    metrics_require_api_key: bool = False
    allowed_origins: list[str] | None = None  # None: local pages only; ["*"]: any page
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False
    max_queued_requests: int | None = None  # None: unbounded

    def __post_init__(self):
        if not all(self.api_keys):
            raise ValueError("api_key must not be empty (several keys are separated by commas, without an empty one)")
        if self.metrics_require_api_key and not self.api_keys:
            raise ValueError("metrics_require_api_key needs an API key: --api-key, or NANOENGINE_API_KEY")
        if self.max_queued_requests is not None and self.max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be a positive integer, got {self.max_queued_requests}")

    @classmethod
    def from_args(cls, args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> "AccessOptions":
        """The command line's options; the keys are ``--api-key``'s (each repeat comma-separated), or
        else the first of ``API_KEY_ENV`` set (comma-separated too)."""
        given = args.api_key or [environ[name] for name in API_KEY_ENV if environ.get(name)][:1]
        return cls(api_keys=[key.strip() for value in given for key in value.split(",")],
                   metrics_require_api_key=args.metrics_require_api_key, allowed_origins=args.allowed_origins,
                   allowed_methods=args.allowed_methods, allowed_headers=args.allowed_headers,
                   allow_credentials=args.allow_credentials, max_queued_requests=args.max_queued_requests)


def install_access(app: FastAPI, options: AccessOptions, rejected: Counter) -> None:
    """Add the bound, the key check and CORS to ``app``; ``rejected`` counts the requests the bound refuses."""
    if options.max_queued_requests is not None:
        app.add_middleware(QueueBound, max_queued_requests=options.max_queued_requests, rejected=rejected)
    if options.api_keys:
        open_paths = OPEN_PATHS if options.metrics_require_api_key else OPEN_PATHS | {"/metrics"}
        app.add_middleware(APIKeyAuth, api_keys=options.api_keys, open_paths=open_paths)
    origins = dict(allow_origin_regex=LOCAL_ORIGINS) if options.allowed_origins is None else \
        dict(allow_origins=options.allowed_origins)
    app.add_middleware(CORSMiddleware, **origins, allow_methods=options.allowed_methods,
                       allow_headers=options.allowed_headers, allow_credentials=options.allow_credentials)


class APIKeyAuth:
    """ASGI middleware: a request for any path outside ``open_paths`` needs a configured key as
    ``Authorization: Bearer <key>``. Keys are compared as SHA-256 digests with
    ``hmac.compare_digest``, every key every time: neither how long a check takes nor which key
    matched says anything about a key's characters or its length."""

    def __init__(self, app, api_keys: list[str], open_paths: frozenset[str]):
        self.app, self.open_paths = app, open_paths
        self.digests = [hashlib.sha256(key.encode()).digest() for key in api_keys]

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            return await self.app(scope, receive, send)
        scheme, _, key = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
        if scheme.lower() != b"bearer":
            return await invalid_api_key("this server needs an API key: send it as the header "
                                         "'Authorization: Bearer <key>'")(scope, receive, send)
        digest, matched = hashlib.sha256(key.strip()).digest(), False
        for known in self.digests:
            matched |= hmac.compare_digest(digest, known)
        if not matched:
            return await invalid_api_key("the API key is not valid")(scope, receive, send)
        await self.app(scope, receive, send)


def invalid_api_key(message: str) -> JSONResponse:
    """OpenAI's own 401 (``type`` ``invalid_request_error``, ``code`` ``invalid_api_key``); the message
    never holds the key (serve_request_log.py logs it)."""
    body = error_body(message)
    body["error"]["code"] = "invalid_api_key"
    return JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})


class QueueBound:
    """ASGI middleware: at most ``max_queued_requests`` POSTs under ``/v1/`` in flight; one more is
    refused (503) before its body is read. The count lives here, on the one instance Starlette
    builds per app, and changes only on the event loop, so it is exact."""

    def __init__(self, app, max_queued_requests: int, rejected: Counter):
        self.app, self.max_queued_requests, self.rejected = app, max_queued_requests, rejected
        self.in_flight = 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        if self.in_flight >= self.max_queued_requests:
            self.rejected.inc()
            return await error_response(
                f"the server is busy: max_queued_requests={self.max_queued_requests} requests are in flight; "
                f"retry after {RETRY_AFTER_SECONDS} s", 503,
                headers={"Retry-After": str(RETRY_AFTER_SECONDS)})(scope, receive, send)
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)  # returns once the response, a stream's last event included, is sent
        finally:
            self.in_flight -= 1


def tls_options(args: argparse.Namespace) -> dict:
    """uvicorn's TLS keywords for ``--ssl-certfile``, ``--ssl-keyfile`` and ``--ssl-ca-certs``, the
    files loaded once here, so that a wrong path or a key that does not match the certificate is a
    usage error before the model loads. With CA certificates, clients must present a certificate
    they signed (mutual TLS): uvicorn would otherwise load them and ask no client for one."""
    if args.ssl_certfile is None:
        if args.ssl_keyfile or args.ssl_ca_certs:
            raise ValueError("--ssl-keyfile and --ssl-ca-certs need --ssl-certfile")
        return {}
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(args.ssl_certfile, args.ssl_keyfile)
    except OSError as e:  # ssl.SSLError included
        raise ValueError(f"--ssl-certfile/--ssl-keyfile: {e}") from None
    try:
        if args.ssl_ca_certs:
            context.load_verify_locations(args.ssl_ca_certs)
    except OSError as e:
        raise ValueError(f"--ssl-ca-certs: {e}") from None
    return dict(ssl_certfile=args.ssl_certfile, ssl_keyfile=args.ssl_keyfile, ssl_ca_certs=args.ssl_ca_certs,
                ssl_cert_reqs=ssl.CERT_REQUIRED if args.ssl_ca_certs else ssl.CERT_NONE)


def is_loopback(host: str) -> bool:
    """Whether only this machine can reach ``host``: a loopback address, or ``localhost``. A name
    that is not an address may resolve to anything, so it counts as reachable."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def warn_if_exposed(host: str, options: AccessOptions) -> None:
    """One warning at start when the server listens beyond this machine and asks for no key."""
    if not is_loopback(host) and not options.api_keys:
        logger.warning("--host %s is not a loopback address and no --api-key is set: the server is open to the "
                       "network, and anyone who can reach it can use it", host)
