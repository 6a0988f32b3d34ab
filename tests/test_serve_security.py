"""Running the server for others (serve_security.py): API keys, the web pages a browser may let read
the answers (CORS), TLS, the bound on requests in flight, and the warning for an exposed host.

Against real servers: one started as a subprocess the way tests/test_serve.py starts its own
(bench_serving.nanoengine_server), and servers built by ``serve.main()`` itself from a command line,
with ``uvicorn.run`` replaced so that the app and uvicorn's keywords main() made are served by
uvicorn on 127.0.0.1, never on the address the command line names.
"""

import datetime
import ipaddress
import json
import logging
import socket
import ssl
import sys
import threading
import uuid
from contextlib import contextmanager
from typing import Iterator

import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
prometheus_parser = pytest.importorskip("prometheus_client.parser")
pytest.importorskip("aiohttp")  # the subprocess server is started through bench_serving.py, an aiohttp client
pytest.importorskip("cryptography")  # the self-signed certificate

from nanoengine.serve_cli_args import make_parser  # noqa: E402
from nanoengine.serve_security import AccessOptions, warn_if_exposed  # noqa: E402
from tests.test_serve import subprocess_server  # noqa: E402

KEYS = ["first-key", "second-key", "third-key"]
MAX_QUEUED = 2
MODEL = "tiny-served"


def tiny(tiny_models) -> list[str]:
    return ["--model", tiny_models["llama"], "--dtype", "float32", "--device", "cpu", "--enforce-eager",
            "--served-model-name", MODEL]


@pytest.fixture(scope="module")
def server_log(tmp_path_factory):
    return tmp_path_factory.mktemp("serve_security") / "server.log"


@pytest.fixture(scope="module")
def keyed(tiny_models, server_log) -> str:
    """A subprocess server with three keys (two given at once, comma-separated) and a bound of two
    requests in flight; the default origins."""
    args = [*tiny(tiny_models), "--api-key", ",".join(KEYS[:2]), "--api-key", KEYS[2],
            "--max-queued-requests", str(MAX_QUEUED)]
    with subprocess_server(args, server_log) as url:
        yield url


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def invalid_api_key(response: httpx.Response) -> str:
    """The message of a 401 in OpenAI's shape, checked to say ``invalid_api_key``."""
    assert response.status_code == 401, response.text
    assert response.headers["www-authenticate"] == "Bearer"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] is None
    assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_api_key")
    return error["message"]


# -- API keys ---------------------------------------------------------------------------------

KEYED_ROUTES = [("GET", "/v1/models", None), ("GET", f"/v1/models/{MODEL}", None),
                ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2}),
                ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
                ("POST", "/tokenize", {"prompt": "hi"}), ("POST", "/detokenize", {"tokens": [100, 200]}),
                ("GET", "/stats", None)]
WRONG_AUTHORIZATION = [{}, bearer("wrong-key"), {"Authorization": "Bearer"}, bearer("first-key,second-key"), bearer("first-ke"),
                       {"Authorization": "first-key"}, {"Authorization": "Basic Zmlyc3Qta2V5OmZpcnN0LWtleQ=="},
                       {"X-API-Key": "first-key"}]


@pytest.mark.parametrize("method, path, body", KEYED_ROUTES)
def test_a_route_needs_one_of_the_keys_as_a_bearer_token(keyed, method, path, body):
    with httpx.Client(base_url=keyed, timeout=30) as http:
        for headers in WRONG_AUTHORIZATION:
            message = invalid_api_key(http.request(method, path, json=body, headers=headers))
            assert "first-key" not in message
        for key in KEYS:
            assert http.request(method, path, json=body, headers=bearer(key)).status_code == 200
        lenient = {"Authorization": f"bearer  {KEYS[0]}"}  # the scheme's case and the spaces after it do not matter
        assert http.request(method, path, json=body, headers=lenient).status_code == 200


def test_the_openai_sdks_api_key_is_the_key(keyed):
    client = openai.OpenAI(base_url=f"{keyed}/v1", api_key=KEYS[1], max_retries=0, timeout=30)
    completion = client.completions.create(model=MODEL, prompt="hi", max_tokens=3, extra_body={"ignore_eos": True})
    assert completion.usage.completion_tokens == 3
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=3, stream=True))
    assert chunks[-1].choices[0].finish_reason is not None
    wrong = openai.OpenAI(base_url=f"{keyed}/v1", api_key="wrong-key", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError) as refused:
        wrong.completions.create(model=MODEL, prompt="hi", max_tokens=3)
    assert refused.value.status_code == 401 and refused.value.code == "invalid_api_key"


@pytest.mark.parametrize("method, path", [("GET", "/health"), ("GET", "/ping"), ("POST", "/ping"),
                                          ("GET", "/version"), ("GET", "/metrics")])
def test_health_ping_version_and_metrics_need_no_key(keyed, method, path):
    assert httpx.request(method, f"{keyed}{path}", headers=bearer("wrong-key"), timeout=30).status_code == 200
    assert httpx.request(method, f"{keyed}{path}", timeout=30).status_code == 200


def test_a_refused_key_is_logged_as_a_401_without_the_key(keyed, server_log):
    secret, request_id = f"secret-{uuid.uuid4().hex}", uuid.uuid4().hex
    response = httpx.get(f"{keyed}/v1/models", headers={**bearer(secret), "X-Request-Id": request_id}, timeout=30)
    invalid_api_key(response)
    log = server_log.read_text()
    lines = [line for line in log.splitlines() if request_id in line]
    assert len(lines) == 1 and "GET /v1/models 401" in lines[0] and "not valid" in lines[0], lines
    assert secret not in log and not any(key in log for key in KEYS)


def test_keys_come_from_the_flags_or_else_the_environment():
    parser = make_parser()

    def keys(argv: list[str], environ: dict) -> list[str]:
        return AccessOptions.from_args(parser.parse_args(argv), environ).api_keys
    both = {"NANOENGINE_API_KEY": "ours", "VLLM_API_KEY": "vllms"}
    assert keys(["--api-key", "a,b", "--api-key", "c"], both) == ["a", "b", "c"]
    assert keys([], both) == ["ours"]
    assert keys([], {"NANOENGINE_API_KEY": "x, y", "VLLM_API_KEY": "vllms"}) == ["x", "y"]
    assert keys([], {"NANOENGINE_API_KEY": "", "VLLM_API_KEY": "vllms"}) == ["vllms"]
    assert keys([], {}) == []


@pytest.mark.parametrize("argv, message", [
    (["--api-key", ""], "api_key must not be empty"),
    (["--api-key", "a,,b"], "api_key must not be empty"),
    (["--metrics-require-api-key"], "metrics_require_api_key needs an API key"),
    (["--max-queued-requests", "0"], "max_queued_requests must be a positive integer, got 0"),
    (["--ssl-keyfile", "key.pem"], "--ssl-keyfile and --ssl-ca-certs need --ssl-certfile"),
    (["--ssl-certfile", "/nonexistent/cert.pem"], "--ssl-certfile/--ssl-keyfile: [Errno 2]"),
    (["--allowed-origins", "https://app.example"], "--allowed-origins: expected a JSON list of strings"),
])
def test_a_bad_access_option_is_a_usage_error_before_the_model_loads(argv, message, monkeypatch, capsys):
    from nanoengine import serve
    for name in ("NANOENGINE_API_KEY", "VLLM_API_KEY"):
        monkeypatch.delenv(name, raising=False)

    def no_engine(*args, **kwargs):
        raise AssertionError("the engine was built")
    monkeypatch.setattr(serve, "AsyncLLMEngine", no_engine)
    monkeypatch.setattr(sys, "argv", ["nanoengine.serve", *argv])
    with pytest.raises(SystemExit) as exited:
        serve.main()
    assert exited.value.code == 2 and message in capsys.readouterr().err


# -- origins (CORS) ------------------------------------------------------------------------------

def preflight(url: str, origin: str) -> httpx.Response:
    return httpx.options(f"{url}/v1/chat/completions", timeout=30, headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})


@pytest.mark.parametrize("origin", ["http://localhost:3000", "https://localhost", "http://127.0.0.1:8080",
                                    "https://[::1]:5173"])
def test_a_page_on_this_machine_may_call_the_server_preflight_without_a_key(keyed, origin):
    allowed = preflight(keyed, origin)
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == origin
    assert allowed.headers["access-control-allow-headers"] == "authorization, content-type"
    answered = httpx.get(f"{keyed}/v1/models", headers={"Origin": origin, **bearer(KEYS[0])}, timeout=30)
    assert answered.status_code == 200 and answered.headers["access-control-allow-origin"] == origin
    refused = httpx.get(f"{keyed}/v1/models", headers={"Origin": origin}, timeout=30)
    invalid_api_key(refused)  # and the page may read why
    assert refused.headers["access-control-allow-origin"] == origin


@pytest.mark.parametrize("origin", ["https://evil.example", "http://localhost.evil.example:3000",
                                    "http://127.0.0.1.evil.example", "http://localhost:3000.evil.example", "null"])
def test_a_foreign_page_gets_no_access_control_allow_origin(keyed, origin):
    refused = preflight(keyed, origin)
    assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers
    answered = httpx.get(f"{keyed}/v1/models", headers={"Origin": origin, **bearer(KEYS[0])}, timeout=30)
    assert answered.status_code == 200 and "access-control-allow-origin" not in answered.headers


# -- servers built by serve.main() --------------------------------------------------------------

@contextmanager
def built_by_main(argv: list[str], monkeypatch) -> Iterator[tuple[object, dict]]:
    """``serve.main()`` run on ``argv`` with ``uvicorn.run`` replaced: the app and uvicorn's keywords it made."""
    from nanoengine import serve
    calls = []
    monkeypatch.setattr(serve.uvicorn, "run", lambda app, **kwargs: calls.append((app, kwargs)))
    monkeypatch.setattr(sys, "argv", ["nanoengine.serve", *argv])
    serve.main()
    [(app, kwargs)] = calls
    yield app, kwargs


@contextmanager
def served(app, kwargs: dict) -> Iterator[int]:
    """``app`` served by uvicorn with main()'s keywords (TLS included) on a port of 127.0.0.1; its
    lifespan shuts the engine down on the way out."""
    config = uvicorn.Config(app, **{k: v for k, v in kwargs.items() if k not in ("host", "port")})
    server = uvicorn.Server(config)
    sock = socket.create_server(("127.0.0.1", 0))  # listening before it starts: connections wait in the backlog
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


@pytest.fixture(scope="module")
def certificate(tmp_path_factory) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1 and localhost, and its key: the files' paths."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "nanoengine test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False, key_agreement=False,
                                         crl_sign=False, encipher_only=False, decipher_only=False), True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(key.public_key()), False)
            .sign(key, hashes.SHA256()))
    root = tmp_path_factory.mktemp("tls")
    (root / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (root / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                     serialization.NoEncryption()))
    return str(root / "cert.pem"), str(root / "key.pem")


def trusting(certificate: tuple[str, str], present_it: bool = False) -> ssl.SSLContext:
    """A client's TLS context that trusts only the test's certificate (and presents it, if asked)."""
    context = ssl.create_default_context(cafile=certificate[0])
    if present_it:
        context.load_cert_chain(*certificate)
    return context


@pytest.fixture(scope="module")
def exposed(tiny_models, certificate) -> Iterator[str]:
    """HTTPS with a self-signed certificate, a key that /metrics needs too, any origin; built by
    main() for --host 0.0.0.0 (and served on 127.0.0.1), with two routes added after create_app."""
    argv = [*tiny(tiny_models), "--host", "0.0.0.0", "--api-key", "exposed-key", "--metrics-require-api-key",
            "--allowed-origins", '["*"]', "--ssl-certfile", certificate[0], "--ssl-keyfile", certificate[1]]
    with pytest.MonkeyPatch.context() as monkeypatch, built_by_main(argv, monkeypatch) as (app, kwargs):
        assert kwargs["ssl_certfile"] == certificate[0] and kwargs["ssl_cert_reqs"] == ssl.CERT_NONE
        app.add_api_route("/v1/added-later", lambda: {"added": "later"}, methods=["POST"])
        app.add_api_route("/admin/added-later", lambda: {"added": "later"}, methods=["POST"])
        with served(app, kwargs) as port:
            yield f"https://127.0.0.1:{port}"


def test_https_with_a_self_signed_certificate_serves_the_openai_sdk(exposed, certificate):
    http_client = httpx.Client(verify=trusting(certificate), timeout=30)
    client = openai.OpenAI(base_url=f"{exposed}/v1", api_key="exposed-key", max_retries=0, http_client=http_client)
    completion = client.completions.create(model=MODEL, prompt="hi", max_tokens=3, extra_body={"ignore_eos": True})
    assert completion.usage.completion_tokens == 3
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):  # not the default trust store's
        httpx.get(f"{exposed}/health", timeout=30)
    with pytest.raises(httpx.TransportError):  # no plain HTTP on the TLS port
        httpx.get(exposed.replace("https:", "http:") + "/health", timeout=30)


def test_metrics_require_api_key_puts_metrics_behind_the_key(exposed, certificate):
    with httpx.Client(base_url=exposed, verify=trusting(certificate), timeout=30) as http:
        invalid_api_key(http.get("/metrics"))
        assert http.get("/metrics", headers=bearer("exposed-key")).status_code == 200
        assert http.get("/health").status_code == 200


def test_a_route_added_later_is_behind_the_key_by_its_path(exposed, certificate):
    with httpx.Client(base_url=exposed, verify=trusting(certificate), timeout=30) as http:
        for path in ("/v1/added-later", "/admin/added-later"):
            invalid_api_key(http.post(path))
            assert http.post(path, headers=bearer("exposed-key")).json() == {"added": "later"}


def test_allowed_origins_star_lets_any_page_call(exposed, certificate):
    with httpx.Client(base_url=exposed, verify=trusting(certificate), timeout=30) as http:
        allowed = http.options("/v1/completions", headers={"Origin": "https://app.example",
                                                           "Access-Control-Request-Method": "POST"})
        assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == "*"


def test_with_ssl_ca_certs_a_client_must_present_a_certificate_they_signed(tiny_models, certificate, monkeypatch):
    argv = [*tiny(tiny_models), "--ssl-certfile", certificate[0], "--ssl-keyfile", certificate[1],
            "--ssl-ca-certs", certificate[0]]
    with built_by_main(argv, monkeypatch) as (app, kwargs), served(app, kwargs) as port:
        assert kwargs["ssl_ca_certs"] == certificate[0] and kwargs["ssl_cert_reqs"] == ssl.CERT_REQUIRED
        url = f"https://127.0.0.1:{port}/health"
        with pytest.raises(httpx.TransportError):  # the handshake, or the first read after it, fails
            httpx.get(url, verify=trusting(certificate), timeout=30)
        assert httpx.get(url, verify=trusting(certificate, present_it=True), timeout=30).status_code == 200


# -- the warning for an exposed host -------------------------------------------------------------

@pytest.mark.parametrize("host, keys, warns", [
    ("127.0.0.1", [], False), ("localhost", [], False), ("::1", [], False), ("127.0.0.2", [], False),
    ("0.0.0.0", [], True), ("::", [], True), ("192.168.1.20", [], True), ("my-host.example", [], True),
    ("0.0.0.0", ["k"], False)])
def test_a_host_beyond_loopback_without_a_key_warns_that_the_server_is_open(host, keys, warns, caplog):
    with caplog.at_level(logging.WARNING, logger="nanoengine.serve_security"):
        warn_if_exposed(host, AccessOptions(api_keys=keys))
    assert [r.getMessage() for r in caplog.records] == (
        [f"--host {host} is not a loopback address and no --api-key is set: the server is open to the network, "
         "and anyone who can reach it can use it"] if warns else [])


@pytest.mark.parametrize("key_in_environment", [False, True])
def test_main_warns_once_at_start_for_an_exposed_host_unless_a_key_is_set(tiny_models, key_in_environment,
                                                                          monkeypatch, caplog):
    for name in ("NANOENGINE_API_KEY", "VLLM_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    if key_in_environment:
        monkeypatch.setenv("VLLM_API_KEY", "from-vllms-variable")
    with caplog.at_level(logging.WARNING, logger="nanoengine.serve_security"), \
            built_by_main([*tiny(tiny_models), "--host", "0.0.0.0"], monkeypatch) as (app, kwargs), \
            served(app, kwargs) as port:
        warnings = [r for r in caplog.records if r.name == "nanoengine.serve_security"]
        assert kwargs["host"] == "0.0.0.0" and len(warnings) == (0 if key_in_environment else 1)
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=30)
        if key_in_environment:
            invalid_api_key(models)
            models = httpx.get(f"http://127.0.0.1:{port}/v1/models", headers=bearer("from-vllms-variable"), timeout=30)
        assert models.status_code == 200


# -- the bound on requests in flight (last: it fills the keyed server's seats) --------------------

def request_head(body: bytes, expect_continue: bool = False) -> bytes:
    return (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEYS[0]}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n"
            + ("Expect: 100-continue\r\n" if expect_continue else "") + "\r\n").encode()


def read_response(sock: socket.socket) -> tuple[int, dict, dict]:
    """Status, headers and JSON body of the response on ``sock``, read to the end (Connection: close)."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    head, _, body = data.removeprefix(b"HTTP/1.1 100 Continue\r\n\r\n").partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode().split("\r\n")
    headers = {name.lower(): value.strip() for name, value in (line.split(":", 1) for line in header_lines)}
    return int(status_line.split()[1]), headers, json.loads(body)


def rejected(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return next(sample.value for family in prometheus_parser.text_string_to_metric_families(text)
                for sample in family.samples if sample.name == "nanoengine:num_requests_rejected_total")


def test_past_max_queued_requests_a_request_gets_a_503_before_its_body_is_read(keyed):
    """Two requests are held in flight by construction: their headers are in, and the server has
    asked for their bodies (100 Continue), which are sent only after the burst. The burst's
    requests never send a body at all: their 503 cannot have waited for one, let alone tokenized it."""
    port = int(keyed.rsplit(":", 1)[1])
    body = json.dumps({"prompt": "The history of trains", "max_tokens": 8, "temperature": 0,
                       "ignore_eos": True}).encode()
    alone = httpx.post(f"{keyed}/v1/completions", content=body, timeout=30,
                       headers={**bearer(KEYS[0]), "Content-Type": "application/json"}).json()
    before = rejected(keyed)
    held = []
    try:
        for _ in range(MAX_QUEUED):
            sock = socket.create_connection(("127.0.0.1", port), timeout=30)
            held.append(sock)
            sock.sendall(request_head(body, expect_continue=True))
            assert sock.recv(len(b"HTTP/1.1 100 Continue\r\n\r\n"), socket.MSG_WAITALL) == \
                b"HTTP/1.1 100 Continue\r\n\r\n"  # admitted, and reading its body
        for _ in range(5):
            with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
                sock.sendall(request_head(body))
                status, headers, refusal = read_response(sock)
            assert status == 503 and headers["retry-after"] == "1"
            error = refusal["error"]
            assert error["type"] == "server_error" and f"max_queued_requests={MAX_QUEUED}" in error["message"]
        # A GET queues nothing on the engine, so it is not counted.
        assert httpx.get(f"{keyed}/v1/models", headers=bearer(KEYS[0]), timeout=30).status_code == 200
        assert rejected(keyed) - before == 5
        for sock in held:
            sock.sendall(body)
        answers = [read_response(sock) for sock in held]
    finally:
        for sock in held:
            sock.close()
    for status, _, answer in answers:  # the held requests, answered in full as if alone
        assert status == 200 and answer["choices"] == alone["choices"] and answer["usage"] == alone["usage"]
