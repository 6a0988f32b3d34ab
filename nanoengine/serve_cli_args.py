"""The server's command line: ``python -m nanoengine.serve --help``. Engine options are ``LLM(...)``'s
keywords with dashes (config.py), the request limits the bounds serving.md's "Limits" lists, the
access options (keys, origins, TLS, the bound on requests in flight) serve_security.py's, the bounds
on stored responses serve_responses.py's, and the server's own flags (host, port, logs, chat template) serve.py's.
"""

import argparse
import json

from nanoengine.serve_limits import MAX_REQUEST_BODY_BYTES
from nanoengine.serve_responses import MAX_STORED_RESPONSES, MAX_STORED_RESPONSES_BYTES


# The engine's options, one line each: a flag's name is the ``LLM(...)`` keyword's (config.py) with
# dashes, and an option left unset keeps the engine's own default.
ENGINE_OPTIONS = {
    "--max-model-len": dict(type=int),
    "--max-num-seqs": dict(type=int),
    "--max-num-batched-tokens": dict(type=int, help="tokens one step may compute"),
    "--num-kvcache-blocks": dict(type=int, help="a fixed number of KV blocks instead of sizing from memory"),
    "--kvcache-block-size": dict(type=int, help="tokens per KV block (default: 256 with flash-attn, else 16)"),
    "--gpu-memory-utilization": dict(type=float, help="the fraction of GPU memory to use, KV cache included"),
    "--dtype": dict(choices=["auto", "float32", "float16", "bfloat16"]),
    "--device": dict(choices=["auto", "cpu", "cuda"]),
    "--quantization": dict(choices=["int8", "int4"], help="weight-only quantization (default: none)"),
    "--enforce-eager": dict(action="store_true", default=None, help="no decode graphs (CUDA or CPU): eager decode"),
    "--enable-prefix-caching": dict(action=argparse.BooleanOptionalAction, help="on unless --no-enable-prefix-caching"),
    # On by default in the server (off offline): a burst of prompts must not freeze running streams.
    "--enable-chunked-prefill": dict(action=argparse.BooleanOptionalAction, default=True,
                                     help="mix decodes and prompt chunks (default: on)"),
    "--tensor-parallel-size": dict(type=int, help="ranks to split the model over (default: 1)"),
    "--attention-backend": dict(choices=["auto", "flash-attn", "triton", "torch"],
                                help="auto: flash-attn on CUDA where installed, else Triton; C++ kernels on CPU"),
    "--kv-cache-dtype": dict(choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"],
                             help="auto: the model's dtype; fp8 (= fp8_e4m3) or fp8_e5m2: K/V in 8 bits, twice "
                                  "the tokens"),
    "--speculative-config": dict(type=json.loads, metavar="JSON", help="speculative decoding, as LLM's dict: "
                                 '\'{"method": "ngram", "num_speculative_tokens": 4}\''),
    "--seed": dict(type=int, help="seeds the draws of requests that bring no seed (default: none, draws differ "
                                  "every run)"),
    "--runner": dict(choices=["generate", "pooling"], help="pooling: a vector per prompt (/v1/embeddings) instead "
                     "of tokens (default: generate)"),
    "--pooler-config": dict(type=json.loads, metavar="JSON", help="with --runner pooling, how to pool: "
                            '\'{"pooling_type": "MEAN", "normalize": true}\' (LAST, MEAN or CLS; default: the model\'s)'),
}


# What one request may ask for. The first three are engine options too (config.py); unset, each
# keeps the engine's default, which the help gives.
LIMIT_OPTIONS = {
    "--max-logprobs": dict(type=int, help="logprobs, top_logprobs or prompt_logprobs a request may ask for "
                                          "(default: 20, as vLLM)"),
    "--max-stop-strings": dict(type=int, help="stop strings a request may give (default: 32)"),
    "--max-stop-string-length": dict(type=int, help="characters in one stop string (default: 256)"),
}


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="An OpenAI-compatible server for nanoengine")
    parser.add_argument("--model", default=None, help="HF model directory or .gguf file (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--served-model-name", help="the model's name in the API (default: --model as given)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=port, default=8000)
    parser.add_argument("--access-log", action="store_true",
                        help="log every request (uvicorn's access log); errors are logged without it")
    parser.add_argument("--chat-template", help="a Jinja chat template, or a file that holds one, run in place of "
                        "the model's (one that renders tools, say)")
    group = parser.add_argument_group("engine options")
    for flag, kwargs in ENGINE_OPTIONS.items():
        group.add_argument(flag, **kwargs)
    limits = parser.add_argument_group("request limits", "a request over one is refused (400, 413) before it "
                                       "is queued; a prompt's length in characters is bounded by max_model_len")
    for flag, kwargs in LIMIT_OPTIONS.items():
        limits.add_argument(flag, **kwargs)
    limits.add_argument("--max-request-body-bytes", type=int, default=MAX_REQUEST_BODY_BYTES,
                        help=f"bytes of a request's body (default: {MAX_REQUEST_BODY_BYTES}, 4 MiB)")
    access = parser.add_argument_group("access", "who may use the server, from which web pages, over what, and "
                                       "how many requests at once (serving.md's \"Running it for others\")")
    access.add_argument("--api-key", action="append", metavar="KEY",
                        help="require 'Authorization: Bearer KEY' on every route but /health, /ping, /version and "
                        "/metrics; repeat it or separate keys by commas (default: NANOENGINE_API_KEY, else "
                        "VLLM_API_KEY, else no key)")
    access.add_argument("--metrics-require-api-key", action="store_true", help="put /metrics behind the key too")
    access.add_argument("--allowed-origins", type=json_list, metavar="JSON",
                        help='web pages a browser lets read the answers (CORS), e.g. \'["https://app.example"]\' '
                        "or '[\"*\"]' (default: pages on localhost, 127.0.0.1 or [::1], any port)")
    access.add_argument("--allowed-methods", type=json_list, default=["*"], metavar="JSON",
                        help="CORS: the methods those pages may use (default: all)")
    access.add_argument("--allowed-headers", type=json_list, default=["*"], metavar="JSON",
                        help="CORS: the headers those pages may send (default: all)")
    access.add_argument("--allow-credentials", action="store_true", help="CORS: let those pages send cookies")
    access.add_argument("--ssl-certfile", metavar="FILE",
                        help="serve HTTPS with this certificate (PEM; it may hold the key too)")
    access.add_argument("--ssl-keyfile", metavar="FILE", help="the certificate's private key (PEM)")
    access.add_argument("--ssl-ca-certs", metavar="FILE",
                        help="require client certificates signed by these CAs (mutual TLS)")
    access.add_argument("--max-queued-requests", type=int, metavar="N",
                        help="POSTs under /v1/ in flight at once, from arrival to the end of the response; "
                        "one more gets a 503 with Retry-After (default: unbounded)")
    stored = parser.add_argument_group("stored responses", "what /v1/responses keeps for previous_response_id "
                                       "and GET /v1/responses/{id}, the oldest evicted first")
    stored.add_argument("--max-stored-responses", type=count, default=MAX_STORED_RESPONSES, metavar="N",
                        help=f"responses kept (default: {MAX_STORED_RESPONSES}; 0 keeps none)")
    stored.add_argument("--max-stored-responses-bytes", type=count, default=MAX_STORED_RESPONSES_BYTES, metavar="N",
                        help=f"bytes of their JSON, inputs included (default: {MAX_STORED_RESPONSES_BYTES}, 64 MiB)")
    return parser


def engine_options(args: argparse.Namespace) -> dict:
    """The engine options the command line set, as ``LLM(...)`` keywords."""
    names = (flag.removeprefix("--").replace("-", "_") for flag in ENGINE_OPTIONS | LIMIT_OPTIONS)
    return {name: value for name in names if (value := getattr(args, name)) is not None}


def json_list(text: str) -> list[str]:
    """A JSON list of strings, as vLLM's CORS flags take them."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not (isinstance(value, list) and all(isinstance(item, str) for item in value)):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, e.g. '[\"https://app.example\"]', "
                                         f"got {text!r}")
    return value


def count(text: str) -> int:
    """A non-negative integer (argparse reports a ValueError as an invalid value)."""
    if (number := int(text)) < 0:
        raise ValueError(text)
    return number


def port(text: str) -> int:
    """A TCP port, 0-65535 (argparse reports a ValueError as an invalid value)."""
    if not 0 <= (number := int(text)) <= 65535:
        raise ValueError(text)
    return number
