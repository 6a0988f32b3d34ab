"""An OpenAI-compatible HTTP server: ``python -m nanoengine.serve --model PATH --port 8000``.

FastAPI turns each request into token ids and ``SamplingParams``, hands them to the
``AsyncLLMEngine`` and turns the tokens that come back into text: whole, or streamed as
server-sent events in OpenAI's chunk format, through a ``Detokenizer``, which also finds stop
strings in the text; one ends the request early. However a response ends (done, stop string,
client gone), its request is aborted, so the KV blocks of a client that disconnects are freed at
once.

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
from jinja2 import TemplateError
from pydantic import BaseModel, ConfigDict

from nanoengine.async_engine import AsyncLLMEngine, EngineDeadError, EngineError, RequestStream
from nanoengine.detokenizer import Detokenizer
from nanoengine.engine import LLMEngine
from nanoengine.loader import DEFAULT_MODEL_FILE
from nanoengine.sampling_params import SamplingParams


class BadRequest(ValueError):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class _Request(BaseModel):
    # Strict: "5" is not an integer. Extras forbidden: an unsupported option (logprobs,
    # presence_penalty, ...) fails loudly instead of being silently ignored.
    model_config = ConfigDict(strict=True, extra="forbid")
    model: str | None = None  # one model is served; the name is echoed back
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # top_k and ignore_eos extend OpenAI's API, as in vLLM
    ignore_eos: bool = False
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: dict[str, bool] | None = None  # {"include_usage": true} adds a usage chunk


class CompletionRequest(_Request):
    prompt: str | list[int]


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    role: Literal["system", "user", "assistant"]
    content: str


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # the newer name for max_tokens


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


def sampling_params(req: _Request, max_tokens: int) -> SamplingParams:
    if req.n != 1:
        raise BadRequest(f"n must be 1 (only one completion per request is supported), got {req.n}", "n")
    if isinstance(req.stop, list) and not all(req.stop) or req.stop == "":
        raise BadRequest("stop strings must not be empty", "stop")
    return SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, seed=req.seed,
                          ignore_eos=req.ignore_eos, max_tokens=max_tokens)


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

    async def generate(request: Request, req: _Request, prompt_ids: list[int], max_tokens: int, chat: bool):
        params = sampling_params(req, max_tokens)
        stream = await engine.add_request(prompt_ids, params)
        text = Detokenizer(engine.tokenizer, [req.stop] if isinstance(req.stop, str) else req.stop or [])
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()),
                "model": model_name}

        def usage() -> dict:
            n = len(text.token_ids)
            return {"prompt_tokens": len(prompt_ids), "completion_tokens": n, "total_tokens": len(prompt_ids) + n}

        async def whole() -> dict:
            try:
                async for finish_reason, _ in deltas(stream, text):
                    pass
            finally:
                stream.abort()
            choice = {"index": 0, "logprobs": None, "finish_reason": finish_reason}
            choice.update({"message": {"role": "assistant", "content": text.text}} if chat else {"text": text.text})
            return {**head, "object": "chat.completion" if chat else "text_completion", "choices": [choice],
                    "usage": usage()}

        if not req.stream:
            return await unless_disconnected(request, whole())

        async def events() -> AsyncIterator[str]:
            obj = "chat.completion.chunk" if chat else "text_completion"

            def chunk(delta: str, finish_reason: str | None, role: bool = False) -> str:
                choice = {"index": 0, "logprobs": None, "finish_reason": finish_reason}
                if chat:
                    choice["delta"] = ({"role": "assistant"} if role else {}) | ({"content": delta} if delta else {})
                else:
                    choice["text"] = delta
                return f"data: {json.dumps({**head, 'object': obj, 'choices': [choice]})}\n\n"

            if chat:
                yield chunk("", None, role=True)
            try:
                async for finish_reason, delta in deltas(stream, text):
                    if delta or finish_reason:
                        yield chunk(delta, finish_reason)
            except EngineError as e:  # the status line has gone out: the error can only be an event
                yield f"data: {json.dumps(error_body(str(e), 'server_error'))}\n\n"
            else:
                if (req.stream_options or {}).get("include_usage"):
                    yield f"data: {json.dumps({**head, 'object': obj, 'choices': [], 'usage': usage()})}\n\n"
            yield "data: [DONE]\n\n"

        return EventStream(events(), stream)

    async def deltas(stream: RequestStream, text: Detokenizer) -> AsyncIterator[tuple[str | None, str]]:
        """(finish_reason, new text) for each engine output; a stop string ends the request early."""
        async for output in stream:
            delta = text.add(output.token_ids, output.finish_reason is not None)
            if text.stopped:
                stream.abort()
            finish_reason = "stop" if text.stopped else output.finish_reason
            yield finish_reason, delta
            if finish_reason:
                return

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        prompt_ids = engine.tokenize(req.prompt)
        max_tokens = 16 if req.max_tokens is None else req.max_tokens  # OpenAI's default
        return await generate(request, req, prompt_ids, max_tokens, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        if not req.messages:
            raise BadRequest("messages must not be empty", "messages")
        try:
            prompt = engine.tokenizer.apply_chat_template([m.model_dump() for m in req.messages], tokenize=False,
                                                          add_generation_prompt=True)
        except TemplateError as e:  # templates may reject a conversation, e.g. roles out of order
            raise BadRequest(f"the chat template rejected the messages: {e}", "messages")
        # The template already holds the special tokens (BOS and the like): add none again.
        prompt_ids = engine.tokenize(engine.tokenizer.encode(prompt, add_special_tokens=False))
        # Unset means "until the context is full", as OpenAI's chat API does.
        max_tokens = next((m for m in (req.max_tokens, req.max_completion_tokens) if m is not None),
                          max(1, max_model_len - len(prompt_ids)))
        return await generate(request, req, prompt_ids, max_tokens, chat=True)

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
