"""An OpenAI-compatible HTTP server: ``python -m nanoengine.serve --model PATH --port 8000``.

FastAPI turns each request (its schema: openai_protocol.py, openai_chat_protocol.py) into token ids
and ``SamplingParams``, hands them to the ``AsyncLLMEngine`` and turns what comes back (each
sample's new tokens, their text and logprobs) into OpenAI's JSON (serve_completions.py): whole, or
streamed as server-sent events in OpenAI's chunk format, one choice per prompt (a completions
request may send a batch, and echo each prompt: openai_prompts.py) and sample (``n``). Stop strings
and stop token ids are the engine's, as offline. However a response ends (done, client gone), its
request is aborted, so the KV blocks of a client that disconnects are freed at once. The event loop
only moves bytes and text: prompts are tokenized and grammars compiled in worker threads, and the
model runs on the engine's own thread. What a request's output must follow (``response_format``,
vLLM's extras, a forced tool call) is openai_structured.py's to read; tools, openai_tool_calls.py's; with
tools, each chat choice's text is split into content and tool calls by openai_tool_parser.py.

Errors are OpenAI's JSON (serve_limits.py): 400 for a bad request, 413 for a body over
``--max-request-body-bytes``, 500 when the step running a request failed (in a stream: an error
event, then ``[DONE]``), 503 from every endpoint, ``/health`` included, once the engine cannot
serve; every error response is logged in one line with its request id (serve_request_log.py). What one
request may ask for is bounded by the flags of the "request limits" group. ``/metrics`` serves
Prometheus's text format (serve_metrics.py), ``/tokenize`` and ``/detokenize`` the server's tokenizer
(serve_tokenization.py); ``/v1/responses``, OpenAI's Responses API, is served by the chat endpoint
(serve_responses.py); ``/v1/embeddings``, a vector per input from a server started with ``--runner
pooling``, serve_embeddings.py's; ``/ping`` (vLLM's) is ``/health``. Who may call it is serve_security.py's:
browsers only from local pages unless ``--allowed-origins`` says otherwise (CORS), an API key with
``--api-key``, HTTPS with ``--ssl-certfile``, and a bound on the requests in flight with
``--max-queued-requests``. The command line's flags are serve_cli_args.py's.
"""

import asyncio
import importlib.metadata
import logging
import os
from contextlib import asynccontextmanager

try:
    import fastapi  # noqa: F401
    import prometheus_client  # noqa: F401
    import uvicorn
except ImportError as e:  # the server's dependencies are an extra: say which, rather than a traceback
    raise SystemExit(f"nanoengine.serve needs {e.name}, which the 'serve' extra installs: "
                     "pip install -e \".[serve]\"") from None
from fastapi import FastAPI, Request
from fastapi.responses import Response

from nanoengine.serve_async_engine import AsyncLLMEngine, EngineDeadError
from nanoengine.serve_cli_args import engine_options, make_parser
from nanoengine.serve_limits import MAX_REQUEST_BODY_BYTES, engine_error_response, error_response, install_error_handlers
from nanoengine.loader import DEFAULT_MODEL_FILE
from nanoengine.serve_metrics import ServerMetrics
from nanoengine.openai_chat_protocol import ChatCompletionRequest
from nanoengine.openai_protocol import BadRequest, CompletionRequest
from nanoengine.openai_prompts import Echo, prompt_batch, tokenize_batch
from nanoengine.serve_completions import generate
from nanoengine.openai_structured import structured_outputs
from nanoengine.serve_request_log import RequestLog
from nanoengine.serve_embeddings import embeddings_router
from nanoengine.serve_responses import ResponseStore, responses_router
from nanoengine.serve_security import AccessOptions, install_access, tls_options, warn_if_exposed
from nanoengine.serve_tokenization import tokenization_router
from nanoengine.openai_tool_calls import ToolChoice


def create_app(engine: AsyncLLMEngine, model_name: str, max_request_body_bytes: int = MAX_REQUEST_BODY_BYTES,
               access: AccessOptions | None = None, responses: ResponseStore | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        engine.shutdown()

    app = FastAPI(title="nanoengine", lifespan=lifespan)
    install_error_handlers(app, max_request_body_bytes)
    metrics = ServerMetrics(model_name)
    install_access(app, access or AccessOptions(), metrics.requests_rejected)  # the bound, the key, CORS
    max_model_len = engine.engine.config.max_model_len
    app.add_middleware(RequestLog)  # request ids, and a log line for every 4xx and 5xx
    app.include_router(tokenization_router(engine))  # /tokenize and /detokenize
    app.include_router(embeddings_router(engine, model_name))  # /v1/embeddings, with --runner pooling

    def check_context(prompt_ids: list[list[int]], max_tokens: int | None, field: str, prompt_field: str) -> None:
        """A 400 for a request whose longest prompt and ``max_tokens`` together overrun the context,
        as vLLM and OpenAI refuse it, rather than a completion cut short where the client asked
        for more; with ``max_tokens`` unset, for a prompt that leaves no room for a token, as vLLM."""
        longest = max(map(len, prompt_ids))
        if max_tokens is None and longest >= max_model_len:
            raise BadRequest(f"This model's maximum context length is {max_model_len} tokens. However, the prompt "
                             f"has {longest} tokens, which leaves no room for the completion. Please reduce the "
                             f"length of the {prompt_field}.", prompt_field)
        if max_tokens is not None and longest + max_tokens > max_model_len:
            raise BadRequest(f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                             f"{longest + max_tokens} tokens ({longest} in the prompt, {max_tokens} in the "
                             f"completion). Please reduce the length of the prompt or {field}.", field)

    def truncation(req: CompletionRequest | ChatCompletionRequest) -> int | None:
        """vLLM's ``truncate_prompt_tokens``, checked before the prompt is tokenized with it."""
        if (k := req.truncate_prompt_tokens) is not None and not (k == -1 or 1 <= k <= max_model_len):
            raise BadRequest(f"truncate_prompt_tokens must be -1 (max_model_len) or an integer in [1, "
                             f"max_model_len={max_model_len}], got {k}", "truncate_prompt_tokens")
        return k

    # Tokenizing and templating run in a worker thread (``asyncio.to_thread``): on the event loop a
    # long prompt would hold up every stream's next token. The fast tokenizer encodes through the
    # Rust library, which releases the GIL; a template (Python) shares it at the interpreter's
    # switch interval.
    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        clock = metrics.clock()
        prompts = prompt_batch(req.prompt)
        prompt_ids = await tokenize_batch(engine, prompts, truncation(req), req.add_special_tokens)
        check_context(prompt_ids, req.max_tokens, "max_tokens", "prompt")
        max_tokens = 16 if req.max_tokens is None else req.max_tokens  # OpenAI's default
        echoed = prompts if req.truncate_prompt_tokens is None else prompt_ids  # what the model reads
        echo = Echo(engine.tokenizer, echoed, prompt_ids, req.n, req.logprobs, drop_sample=max_tokens == 0) \
            if req.echo else None
        # Echo with logprobs scores the prompt: its tokens' logprobs, as many top ones as the sampled tokens'.
        prompt_logprobs = req.logprobs if req.echo and req.prompt_logprobs is None else req.prompt_logprobs
        return await generate(engine, model_name, request, req, prompt_ids, 1 if echo and echo.drop_sample else max_tokens, chat=False,
                              logprobs=req.logprobs, clock=clock, prompt_logprobs=prompt_logprobs, echo=echo,
                              structured=await structured_outputs(engine, req))

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        clock = metrics.clock()
        if not req.messages:
            raise BadRequest("messages must not be empty", "messages")
        if req.top_logprobs is not None and not req.logprobs:
            raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= (limit := engine.engine.config.max_logprobs):
            raise BadRequest(f"top_logprobs must be in [0, max_logprobs={limit}], got {req.top_logprobs}",
                             "top_logprobs")
        tools = ToolChoice.of(req)
        prompt_ids = await asyncio.to_thread(
            tools.chat_prompt, engine, [m.for_template() for m in req.messages], req.chat_template_kwargs,
            add_generation_prompt=req.add_generation_prompt, continue_final_message=req.continue_final_message,
            truncate_prompt_tokens=truncation(req), documents=req.documents)
        # Unset means "until the context is full", as OpenAI's chat API does; with both set, the newer
        # name wins (max_tokens is deprecated), as in vLLM.
        field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        check_context([prompt_ids], requested := getattr(req, field), field, "messages")
        max_tokens = requested if requested is not None else max(1, max_model_len - len(prompt_ids))
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        last = req.messages[-1]  # the reply is in its role without a generation prompt, else the assistant's
        echo = Echo(engine.tokenizer, [last.for_template()["content"]], [prompt_ids], req.n, None, drop_sample=False) \
            if req.echo and (not req.add_generation_prompt or last.role == "assistant") else None
        return await generate(engine, model_name, request, req, [prompt_ids], max_tokens, chat=True, logprobs=logprobs, clock=clock,
                              prompt_logprobs=req.prompt_logprobs, echo=echo,
                              structured=await structured_outputs(engine, req, tools), tools=tools)

    # /v1/responses and its stored responses: a Responses request is served as a chat request, here.
    app.include_router(responses_router(model_name, chat_completions, responses or ResponseStore()))

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
    @app.api_route("/ping", methods=["GET", "POST"])  # vLLM's name for it (SageMaker's)
    async def health():
        if (error := engine.error) is not None:
            return engine_error_response(EngineDeadError(error))
        return {"status": "ok"}

    @app.get("/version")
    async def version():
        return {"version": importlib.metadata.version("nanoengine")}

    @app.get("/stats")
    async def stats():
        return await engine.stats()

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(await engine.stats()), media_type=metrics.content_type)

    return app


def use_chat_template(engine: AsyncLLMEngine, template: str) -> None:
    """``--chat-template`` (vLLM's): a template's text, or a file that holds one, in place of the
    model's, for every chat and ``/tokenize``; a ``ValueError`` if it cannot render a conversation."""
    if os.path.isfile(template):
        with open(template) as file:
            template = file.read()
    engine.tokenizer.chat_template = template
    engine.chat_prompt([{"role": "user", "content": "hi"}])


def main() -> None:
    parser = make_parser()
    args = parser.parse_args()
    if args.max_request_body_bytes < 1:
        parser.error(f"--max-request-body-bytes must be a positive integer, got {args.max_request_body_bytes}")
    try:
        access, tls = AccessOptions.from_args(args), tls_options(args)
    except ValueError as e:
        parser.error(str(e))
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")  # request_log's error lines
    warn_if_exposed(args.host, access)
    try:
        engine = AsyncLLMEngine(args.model, **engine_options(args))
    except ValueError as e:
        parser.error(str(e))
    if args.chat_template is not None:
        try:
            use_chat_template(engine, args.chat_template)
        except ValueError as e:
            engine.shutdown()
            parser.error(f"--chat-template: {e}")
    model_name = args.served_model_name or args.model or DEFAULT_MODEL_FILE.removesuffix(".gguf")
    app = create_app(engine, model_name, args.max_request_body_bytes, access,
                     responses=ResponseStore(args.max_stored_responses, args.max_stored_responses_bytes))
    uvicorn.run(app, host=args.host, port=args.port, log_level="info" if args.access_log else "warning",
                access_log=args.access_log, **tls)


if __name__ == "__main__":
    main()
