"""An OpenAI-compatible HTTP server: ``python -m nanoengine.serve --model PATH --port 8000``.

FastAPI turns each request (its schema: openai_protocol.py) into token ids and
``SamplingParams``, hands them to the ``AsyncLLMEngine`` and turns what comes back (each sample's
new tokens, their text and logprobs) into OpenAI's JSON: whole, or streamed as server-sent events
in OpenAI's chunk format, one choice per prompt (a completions request may send a batch, and
echo each prompt: openai_prompts.py) and sample (``n``). Stop strings and stop token ids are the
engine's, as offline. However a response ends (done, client gone), its request is aborted, so the
KV blocks of a client that disconnects are freed at once. The event loop only moves bytes and
text: prompts are tokenized and grammars compiled in worker threads, and the model runs on the
engine's own thread. What a request's output must follow (``response_format``, vLLM's extras, a
forced tool call) is openai_structured.py's to read; tools, tool_calls.py's; with tools, each chat
choice's text is split into content and tool calls by tool_parser.py.

Errors are OpenAI's JSON (limits.py): 400 for a bad request, 413 for a body over
``--max-request-body-bytes``, 500 when the step running a request failed (in a stream: an error
event, then ``[DONE]``), 503 from every endpoint, ``/health`` included, once the engine cannot
serve; every error response is logged in one line with its request id (request_log.py). What one
request may ask for is bounded by the flags of the "request limits" group. ``/metrics`` serves
Prometheus's text format (metrics.py), ``/tokenize`` and ``/detokenize`` the server's tokenizer
(serving_tokenization.py).
"""

import argparse
import asyncio
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import AsyncIterator, Awaitable

try:
    import fastapi  # noqa: F401
    import prometheus_client  # noqa: F401
    import uvicorn
except ImportError as e:  # the server's dependencies are an extra: say which, rather than a traceback
    raise SystemExit(f"nanoengine.serve needs {e.name}, which the 'serve' extra installs: "
                     "pip install -e \".[serve]\"") from None
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from nanoengine.async_engine import AsyncLLMEngine, EngineDeadError, EngineError, RequestStream
from nanoengine.limits import MAX_REQUEST_BODY_BYTES, engine_error_response, error_response, install_error_handlers
from nanoengine.loader import DEFAULT_MODEL_FILE
from nanoengine.metrics import RequestClock, ServerMetrics
from nanoengine.openai_protocol import (BadRequest, ChatCompletionRequest, CompletionRequest, OpenAIRequest,
                                        chat_logprobs, completion_logprobs, error_body, sampling_params)
from nanoengine.openai_prompts import Echo, prompt_batch, tokenize_batch, vllm_prompt_logprobs
from nanoengine.openai_structured import structured_outputs
from nanoengine.request_log import RequestLog
from nanoengine.sampling_params import StructuredOutputsParams
from nanoengine.serving_tokenization import tokenization_router
from nanoengine.tool_calls import ToolChoice


class EventStream(StreamingResponse):
    """Server-sent events that abort their request however the response ends, a client gone included."""

    def __init__(self, events: AsyncIterator[str], stream: RequestStream):
        super().__init__(events, media_type="text/event-stream")
        self.stream = stream

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.stream.abort()


async def unless_disconnected(request: Request, work: Awaitable[dict]) -> dict | Response:
    """Await ``work``, cancelling it (and so aborting its request) if the client disconnects first.

    FastAPI has read the body, so the next ASGI message is the disconnect: waiting for it costs
    nothing, where polling ``request.is_disconnected()`` would need a timer.
    """
    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
    work, disconnect = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait([work, disconnect], return_when=asyncio.FIRST_COMPLETED)
    finally:
        work.cancel()  # a no-op once it is done; otherwise its request is aborted as it unwinds
        disconnect.cancel()
    if work in done:
        return work.result()
    return Response(status_code=499)  # nginx's "client closed request": nobody is left to read it


def create_app(engine: AsyncLLMEngine, model_name: str,
               max_request_body_bytes: int = MAX_REQUEST_BODY_BYTES) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        engine.shutdown()

    app = FastAPI(title="nanoengine", lifespan=lifespan)
    install_error_handlers(app, max_request_body_bytes)
    max_model_len = engine.engine.config.max_model_len
    metrics = ServerMetrics(model_name)
    app.add_middleware(RequestLog)  # request ids, and a log line for every 4xx and 5xx
    app.include_router(tokenization_router(engine))  # /tokenize and /detokenize

    async def generate(request: Request, req: OpenAIRequest, prompt_ids: list[list[int]], max_tokens: int, chat: bool,
                       logprobs: int | None, clock: RequestClock, prompt_logprobs: int | None = None,
                       echo: Echo | None = None, structured: StructuredOutputsParams | None = None,
                       tools: ToolChoice | None = None):
        """Answer a request for one or more prompts (a completions batch): a choice per prompt and
        sample, numbered ``prompt_index * n + sample_index``, as OpenAI and vLLM do."""
        if req.prompt_logprobs is not None and req.stream:  # as in vLLM (echo's own go in the first chunk)
            raise BadRequest("prompt_logprobs is not available with stream: true", "prompt_logprobs")
        params = replace(sampling_params(req, max_tokens, logprobs), prompt_logprobs=prompt_logprobs,
                         structured_outputs=structured)
        stream = await engine.add_requests(prompt_ids, params)
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()),
                "model": model_name}
        num_choices = len(prompt_ids) * req.n
        num_tokens = [0] * num_choices  # per choice
        scored = [None] * len(prompt_ids)  # per prompt, the engine's prompt_logprobs, if asked
        # Per chat choice, with tools: its text split into content and tool calls (tool_parser.py).
        parsers = [tools.parser() if tools else None for _ in range(num_choices)]

        def usage() -> dict:
            n, num_prompt_tokens = sum(num_tokens), sum(map(len, prompt_ids))
            return {"prompt_tokens": num_prompt_tokens, "completion_tokens": n, "total_tokens": num_prompt_tokens + n}

        def choice(index: int, text: str, finish_reason: str | None, token_logprobs: list | None, offset: int) -> dict:
            """A choice of a response, or of a chunk when streaming; ``offset``: the length of its text before."""
            logprobs_json = None
            if logprobs is not None and token_logprobs:
                logprobs_json = (chat_logprobs(engine.tokenizer, token_logprobs, logprobs) if chat
                                 else completion_logprobs(engine.tokenizer, token_logprobs, offset))
            calls = None
            if (parser := parsers[index]) is not None:  # streamed: the calls' deltas; whole: the calls
                text, calls = parser.feed(text, final=finish_reason is not None or not req.stream)
                calls = calls if req.stream else parser.calls
                finish_reason = "tool_calls" if finish_reason == "stop" and parser.calls else finish_reason
            if chat and req.stream:
                content = {"delta": {"content": text} if text else {}}
                content["delta"].update({"tool_calls": calls} if calls else {})
            else:
                message = {"role": "assistant", "content": text, "refusal": None}
                message.update({"content": text or None, "tool_calls": calls} if calls else {})
                content = {"message": message} if chat else {"text": text}
            return {"index": index, "logprobs": logprobs_json, "finish_reason": finish_reason, **content}

        async def whole() -> dict:
            texts, token_logprobs = [[] for _ in range(num_choices)], [[] for _ in range(num_choices)]
            finish_reasons = [None] * num_choices
            try:
                async for out in stream:
                    clock.output(out.step)
                    if out.prompt_logprobs is not None:
                        scored[out.index // req.n] = out.prompt_logprobs
                    out = echo(out) if echo is not None else out
                    texts[out.index].append(out.text)
                    num_tokens[out.index] += len(out.token_ids)
                    finish_reasons[out.index] = out.finish_reason
                    token_logprobs[out.index] += out.logprobs or []
            except EngineError:
                clock.finish("error")
                raise
            finally:
                stream.abort()
                clock.finish(finish_reasons[0] or "abort")  # unfinished: the client left
            choices = [choice(i, "".join(texts[i]), finish_reasons[i], token_logprobs[i], 0) for i in range(num_choices)]
            if req.prompt_logprobs is not None:  # vLLM's extension: in each choice, or in a chat response
                shaped = [vllm_prompt_logprobs(engine.tokenizer, s, prompt_logprobs) for s in scored]
                if chat:
                    head["prompt_logprobs"] = shaped[0]
                else:
                    for c in choices:
                        c["prompt_logprobs"] = shaped[c["index"] // req.n]
            return {**head, "object": "chat.completion" if chat else "text_completion", "choices": choices,
                    "usage": usage(), "system_fingerprint": None}  # as vLLM sends it

        if not req.stream:
            return await unless_disconnected(request, whole())

        async def events() -> AsyncIterator[str]:
            obj = "chat.completion.chunk" if chat else "text_completion"

            def event(choice: dict) -> str:
                return f"data: {json.dumps({**head, 'object': obj, 'choices': [choice]})}\n\n"

            if chat:
                for i in range(req.n):
                    yield event({"index": i, "logprobs": None, "finish_reason": None, "delta": {"role": "assistant"}})
            text_lengths, finish_reason = [0] * num_choices, "abort"  # until sample 0 ends: the client may leave first
            try:
                async for out in stream:
                    clock.output(out.step)
                    if out.finish_reason and out.index == 0:
                        finish_reason = out.finish_reason
                    out = echo(out) if echo is not None else out
                    if out.text or out.finish_reason or out.logprobs:
                        yield event(choice(out.index, out.text, out.finish_reason, out.logprobs,
                                           text_lengths[out.index]))
                    text_lengths[out.index] += len(out.text)
                    num_tokens[out.index] += len(out.token_ids)
            except EngineError as e:  # the status line has gone out: the error can only be an event
                finish_reason = "error"
                yield f"data: {json.dumps(error_body(str(e), 'server_error'))}\n\n"
            else:
                if (req.stream_options or {}).get("include_usage"):
                    yield f"data: {json.dumps({**head, 'object': obj, 'choices': [], 'usage': usage()})}\n\n"
            finally:
                clock.finish(finish_reason)
            yield "data: [DONE]\n\n"

        return EventStream(events(), stream)

    # Tokenizing and templating run in a worker thread (``asyncio.to_thread``): on the event loop a
    # long prompt would hold up every stream's next token. The fast tokenizer encodes through the
    # Rust library, which releases the GIL; a template (Python) shares it at the interpreter's
    # switch interval.
    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        clock = metrics.clock()
        prompts = prompt_batch(req.prompt)
        prompt_ids = await tokenize_batch(engine, prompts)
        max_tokens = 16 if req.max_tokens is None else req.max_tokens  # OpenAI's default
        echo = Echo(engine.tokenizer, prompts, prompt_ids, req.n, req.logprobs, drop_sample=max_tokens == 0) \
            if req.echo else None
        # Echo with logprobs scores the prompt: its tokens' logprobs, as many top ones as the sampled tokens'.
        prompt_logprobs = req.logprobs if req.echo and req.prompt_logprobs is None else req.prompt_logprobs
        return await generate(request, req, prompt_ids, 1 if echo and echo.drop_sample else max_tokens, chat=False,
                              logprobs=req.logprobs, clock=clock, prompt_logprobs=prompt_logprobs, echo=echo,
                              structured=await structured_outputs(engine, req))

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        clock = metrics.clock()
        if not req.messages:
            raise BadRequest("messages must not be empty", "messages")
        if req.top_logprobs is not None and not req.logprobs:
            raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
        tools = ToolChoice.of(req)
        try:
            prompt_ids = await asyncio.to_thread(tools.chat_prompt, engine, [m.for_template() for m in req.messages],
                                                 req.chat_template_kwargs)
        except BadRequest:
            raise
        except ValueError as e:  # about the prompt the engine makes of the messages, or the template's variables
            field = "chat_template_kwargs" if str(e).startswith("chat_template_kwargs") else "messages"
            raise BadRequest(str(e), field) from None
        # Unset means "until the context is full", as OpenAI's chat API does.
        max_tokens = next((m for m in (req.max_tokens, req.max_completion_tokens) if m is not None),
                          max(1, max_model_len - len(prompt_ids)))
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        return await generate(request, req, [prompt_ids], max_tokens, chat=True, logprobs=logprobs, clock=clock,
                              prompt_logprobs=req.prompt_logprobs,
                              structured=await structured_outputs(engine, req, tools.grammar), tools=tools)

    card = {"id": model_name, "object": "model", "created": 0, "owned_by": "nanoengine", "max_model_len": max_model_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model_id:path}")  # a served name may hold slashes ("org/model")
    async def model(model_id: str):
        if model_id != model_name:
            return error_response(f"The model `{model_id}` does not exist.", 404, param="model")
        return card

    @app.get("/health")
    async def health():
        if (error := engine.error) is not None:
            return engine_error_response(EngineDeadError(error))
        return {"status": "ok"}

    @app.get("/stats")
    async def stats():
        return await engine.stats()

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(await engine.stats()), media_type=metrics.content_type)

    return app


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
    "--speculative-config": dict(type=json.loads, metavar="JSON", help="speculative decoding, as LLM's dict: "
                                 '\'{"method": "ngram", "num_speculative_tokens": 4}\''),
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
    parser.add_argument("--model", default=None, help="HF model directory or .gguf file (default: SmolLM2-135M)")
    parser.add_argument("--served-model-name", help="the model's name in the API (default: --model as given)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--access-log", action="store_true",
                        help="log every request (uvicorn's access log); errors are logged without it")
    group = parser.add_argument_group("engine options")
    for flag, kwargs in ENGINE_OPTIONS.items():
        group.add_argument(flag, **kwargs)
    limits = parser.add_argument_group("request limits", "a request over one is refused (400, 413) before it "
                                       "is queued; a prompt's length in characters is bounded by max_model_len")
    for flag, kwargs in LIMIT_OPTIONS.items():
        limits.add_argument(flag, **kwargs)
    limits.add_argument("--max-request-body-bytes", type=int, default=MAX_REQUEST_BODY_BYTES,
                        help=f"bytes of a request's body (default: {MAX_REQUEST_BODY_BYTES}, 4 MiB)")
    return parser


def engine_options(args: argparse.Namespace) -> dict:
    """The engine options the command line set, as ``LLM(...)`` keywords."""
    names = (flag.removeprefix("--").replace("-", "_") for flag in ENGINE_OPTIONS | LIMIT_OPTIONS)
    return {name: value for name in names if (value := getattr(args, name)) is not None}


def main() -> None:
    parser = make_parser()
    args = parser.parse_args()
    if args.max_request_body_bytes < 1:
        parser.error(f"--max-request-body-bytes must be a positive integer, got {args.max_request_body_bytes}")
    try:
        engine = AsyncLLMEngine(args.model, **engine_options(args))
    except ValueError as e:
        parser.error(str(e))
    model_name = args.served_model_name or args.model or DEFAULT_MODEL_FILE.removesuffix(".gguf")
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")  # request_log's error lines
    app = create_app(engine, model_name, args.max_request_body_bytes)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info" if args.access_log else "warning",
                access_log=args.access_log)


if __name__ == "__main__":
    main()
