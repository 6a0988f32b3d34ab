"""An OpenAI-compatible HTTP server: ``python -m nanoengine.serve --model PATH --port 8000``.

FastAPI turns each request into token ids and ``SamplingParams``, hands them to the
``AsyncLLMEngine`` and turns what comes back (each sample's new tokens, their text and logprobs)
into OpenAI's JSON: whole, or streamed as server-sent events in OpenAI's chunk format, one choice
per sample (``n``). Stop strings and stop token ids are the engine's, as offline. However a
response ends (done, client gone), its request is aborted, so the KV blocks of a client that
disconnects are freed at once.

Errors are OpenAI's JSON: 400 for a bad request, 500 when the step running a request failed
(in a stream: an error event, then ``[DONE]``), 503 from every endpoint, ``/health`` included,
once the engine thread has stopped.
"""

import argparse
import asyncio
import json
import time
import uuid
from contextlib import asynccontextmanager
from typing import AsyncIterator, Awaitable, Literal

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict

from nanoengine.async_engine import AsyncLLMEngine, EngineDeadError, EngineError, RequestStream
from nanoengine.engine import LLMEngine
from nanoengine.loader import DEFAULT_MODEL_FILE
from nanoengine.sampling_params import SamplingParams


class BadRequest(ValueError):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class _Request(BaseModel):
    # Strict: "5" is not an integer. Extras forbidden: an unsupported option (presence_penalty,
    # logit_bias, ...) fails loudly instead of being silently ignored.
    model_config = ConfigDict(strict=True, extra="forbid")
    model: str | None = None  # one model is served; the name is echoed back
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # top_k and ignore_eos extend OpenAI's API, as in vLLM
    ignore_eos: bool = False
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # an extension, as in vLLM
    n: int = 1
    stream: bool = False
    stream_options: dict[str, bool] | None = None  # {"include_usage": true} adds a usage chunk


class CompletionRequest(_Request):
    prompt: str | list[int]
    logprobs: int | None = None  # how many top tokens' logprobs to return beside each sampled one


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    role: Literal["system", "user", "assistant"]
    content: str


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # the newer name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None  # with logprobs: how many top tokens' logprobs beside each sampled one


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


def error_body(message: str, error_type: str = "invalid_request_error", param: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": None}}


def error_response(message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, param=param), status_code=400)


def engine_error_response(exc: EngineError) -> JSONResponse:
    return JSONResponse(error_body(str(exc), "server_error"),
                        status_code=503 if isinstance(exc, EngineDeadError) else 500)


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


def sampling_params(req: _Request, max_tokens: int, logprobs: int | None) -> SamplingParams:
    return SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, seed=req.seed,
                          ignore_eos=req.ignore_eos, max_tokens=max_tokens, n=req.n, logprobs=logprobs,
                          stop=req.stop, stop_token_ids=req.stop_token_ids)


def completion_logprobs(tokenizer, logprobs: list[dict[int, float]], offset: int) -> dict:
    """The completions API's shape: each token's text and logprob, its top alternatives by text,
    and where each token's text starts (``offset``: the length of the choice's text before them)."""
    tokens = [tokenizer.decode([next(iter(top))]) for top in logprobs]
    starts = [offset + sum(map(len, tokens[:i])) for i in range(len(tokens))]
    return {"tokens": tokens, "token_logprobs": [next(iter(top.values())) for top in logprobs],
            "top_logprobs": [{tokenizer.decode([t]): lp for t, lp in top.items()} for top in logprobs],
            "text_offset": starts}


def chat_logprobs(tokenizer, logprobs: list[dict[int, float]], num_top: int) -> dict:
    """The chat API's shape: per token its text, bytes, logprob and its ``num_top`` best alternatives."""
    def entry(token_id: int, logprob: float) -> dict:
        text = tokenizer.decode([token_id])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
    return {"content": [{**entry(*next(iter(top.items()))),
                         "top_logprobs": [entry(*item) for item in sorted(top.items(), key=lambda x: -x[1])[:num_top]]}
                        for top in logprobs]}


def create_app(engine: AsyncLLMEngine, model_name: str) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        engine.shutdown()

    app = FastAPI(title="nanoengine", lifespan=lifespan)
    max_model_len = engine.engine.config.max_model_len

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = exc.errors()[0]
        if err["type"] == "json_invalid":
            return error_response(f"the request body is not valid JSON: {err.get('ctx', {}).get('error', '')}")
        loc = [str(x) for x in err["loc"] if x != "body"]
        return error_response(f"{'.'.join(loc) or 'body'}: {err['msg']}", loc[0] if loc else None)

    @app.exception_handler(EngineError)  # a failed step (500), or the engine thread gone (503)
    async def on_engine_error(request: Request, exc: EngineError) -> JSONResponse:
        return engine_error_response(exc)

    @app.exception_handler(ValueError)  # BadRequest, SamplingParams' checks, a prompt too long...
    async def on_value_error(request: Request, exc: ValueError) -> JSONResponse:
        return error_response(str(exc), getattr(exc, "param", None))

    async def generate(request: Request, req: _Request, prompt_ids: list[int], max_tokens: int, chat: bool,
                       logprobs: int | None):
        stream = await engine.add_request(prompt_ids, sampling_params(req, max_tokens, logprobs))
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()),
                "model": model_name}
        num_tokens = [0] * req.n  # per sample (choice index)

        def usage() -> dict:
            n = sum(num_tokens)
            return {"prompt_tokens": len(prompt_ids), "completion_tokens": n, "total_tokens": len(prompt_ids) + n}

        def choice(index: int, text: str, finish_reason: str | None, token_logprobs: list | None, offset: int) -> dict:
            """A choice of a response, or of a chunk when streaming; ``offset``: the length of its text before."""
            logprobs_json = None
            if logprobs is not None and token_logprobs:
                logprobs_json = (chat_logprobs(engine.tokenizer, token_logprobs, logprobs) if chat
                                 else completion_logprobs(engine.tokenizer, token_logprobs, offset))
            if chat and req.stream:
                content = {"delta": {"content": text} if text else {}}
            else:
                content = {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
            return {"index": index, "logprobs": logprobs_json, "finish_reason": finish_reason, **content}

        async def whole() -> dict:
            texts, token_logprobs = [[] for _ in range(req.n)], [[] for _ in range(req.n)]
            finish_reasons = [None] * req.n
            try:
                async for out in stream:
                    texts[out.index].append(out.text)
                    num_tokens[out.index] += len(out.token_ids)
                    finish_reasons[out.index] = out.finish_reason
                    token_logprobs[out.index] += out.logprobs or []
            finally:
                stream.abort()
            choices = [choice(i, "".join(texts[i]), finish_reasons[i], token_logprobs[i], 0) for i in range(req.n)]
            return {**head, "object": "chat.completion" if chat else "text_completion", "choices": choices,
                    "usage": usage()}

        if not req.stream:
            return await unless_disconnected(request, whole())

        async def events() -> AsyncIterator[str]:
            obj = "chat.completion.chunk" if chat else "text_completion"

            def event(choice: dict) -> str:
                return f"data: {json.dumps({**head, 'object': obj, 'choices': [choice]})}\n\n"

            if chat:
                for i in range(req.n):
                    yield event({"index": i, "logprobs": None, "finish_reason": None, "delta": {"role": "assistant"}})
            text_lengths = [0] * req.n
            try:
                async for out in stream:
                    if out.text or out.finish_reason or out.logprobs:
                        yield event(choice(out.index, out.text, out.finish_reason, out.logprobs,
                                           text_lengths[out.index]))
                    text_lengths[out.index] += len(out.text)
                    num_tokens[out.index] += len(out.token_ids)
            except EngineError as e:  # the status line has gone out: the error can only be an event
                yield f"data: {json.dumps(error_body(str(e), 'server_error'))}\n\n"
            else:
                if (req.stream_options or {}).get("include_usage"):
                    yield f"data: {json.dumps({**head, 'object': obj, 'choices': [], 'usage': usage()})}\n\n"
            yield "data: [DONE]\n\n"

        return EventStream(events(), stream)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        prompt_ids = engine.tokenize(req.prompt)
        max_tokens = 16 if req.max_tokens is None else req.max_tokens  # OpenAI's default
        return await generate(request, req, prompt_ids, max_tokens, chat=False, logprobs=req.logprobs)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        if not req.messages:
            raise BadRequest("messages must not be empty", "messages")
        if req.top_logprobs is not None and not req.logprobs:
            raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
        prompt_ids = engine.chat_prompt([m.model_dump() for m in req.messages])
        # Unset means "until the context is full", as OpenAI's chat API does.
        max_tokens = next((m for m in (req.max_tokens, req.max_completion_tokens) if m is not None),
                          max(1, max_model_len - len(prompt_ids)))
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        return await generate(request, req, prompt_ids, max_tokens, chat=True, logprobs=logprobs)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "nanoengine", "max_model_len": max_model_len}]}

    @app.get("/health")
    async def health():
        if engine.error is not None:
            return engine_error_response(EngineDeadError(engine.error))
        return {"status": "ok"}

    @app.get("/stats")
    async def stats():
        return await engine.stats()

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description="An OpenAI-compatible server for nanoengine")
    parser.add_argument("--model", default=None, help="HF model directory or .gguf file (default: SmolLM2-135M)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--max-num-seqs", type=int)
    parser.add_argument("--num-kvcache-blocks", type=int)
    parser.add_argument("--dtype", choices=["auto", "float32", "float16", "bfloat16"])
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--quantization", choices=["int8", "int4"], help="weight-only quantization (default: none)")
    parser.add_argument("--tensor-parallel-size", type=int, help="ranks to split the model over (default: 1)")
    args = parser.parse_args()
    options = {k: v for k in ("max_model_len", "max_num_seqs", "num_kvcache_blocks", "dtype", "device", "quantization",
                              "tensor_parallel_size")
               if (v := getattr(args, k)) is not None}
    try:
        engine = LLMEngine(args.model, **options)
    except ValueError as e:
        parser.error(str(e))
    model_name = args.model or DEFAULT_MODEL_FILE.removesuffix(".gguf")
    uvicorn.run(create_app(AsyncLLMEngine(engine), model_name), host=args.host, port=args.port,
                log_level="warning")


if __name__ == "__main__":
    main()
