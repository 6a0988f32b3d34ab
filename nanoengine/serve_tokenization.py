"""vLLM's ``/tokenize`` and ``/detokenize``: the server's own tokenizer over HTTP, so a client can
count and split tokens exactly as the server does (an evaluation harness sizing its windows, a
client checking a prompt against ``max_model_len`` before sending it).

The fields are vLLM's. ``/tokenize`` takes a ``prompt`` (encoded with ``add_special_tokens``,
default true, as the completions endpoint encodes a text prompt) or chat ``messages`` (rendered and
tokenized by the chat template as the chat endpoint does, with ``add_generation_prompt``, default
true, or ``continue_final_message``; ``tools`` and ``chat_template_kwargs`` too) and answers
``count``, ``max_model_len``, ``tokens`` and, with ``return_token_strs``, each token's string in the
vocabulary. A prompt longer than ``max_model_len`` is tokenized all the same: saying how long it is
is the point (a conversation, up to the characters ``max_model_len`` tokens could hold, as the
chat endpoint bounds it). ``/detokenize`` takes ``tokens`` and
answers the ``prompt`` they decode to.
"""

import asyncio
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from nanoengine.serve_async_engine import AsyncLLMEngine
from nanoengine.openai_chat_protocol import ChatMessage, Tool
from nanoengine.openai_protocol import BadRequest
from nanoengine.openai_tool_calls import ToolChoice


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    model: str | None = None  # one model is served
    prompt: str | None = None  # either a text...
    messages: list[ChatMessage] | None = None  # ...or a conversation
    add_special_tokens: bool = True  # text only: the chat template writes a conversation's own
    add_generation_prompt: bool = True  # messages only
    continue_final_message: bool = False  # messages only: the last message left open, as the chat endpoint takes it
    tools: list[Tool] | None = None  # messages only, rendered as the chat endpoint renders them
    chat_template_kwargs: dict[str, Any] | None = None  # messages only
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    model: str | None = None
    tokens: list[int]


def tokenize(engine: AsyncLLMEngine, req: TokenizeRequest) -> list[int]:
    if (req.prompt is None) == (req.messages is None):
        raise BadRequest("give either prompt (a text) or messages (a conversation)", "prompt")
    if req.prompt is not None:
        try:  # lone surrogates: not text the tokenizer takes (not bounded: counting a long text is the point)
            engine.engine.input_processor.check_prompt_text(req.prompt, bounded=False)
        except ValueError as e:
            raise BadRequest(str(e), "prompt") from None
        return engine.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    # As the chat endpoint renders it, tools included, so a client counts what a chat request sends.
    tools = ToolChoice([tool.model_dump(exclude_none=True) for tool in req.tools or []], "auto", [], True)
    return tools.chat_prompt(engine, [m.for_template() for m in req.messages], req.chat_template_kwargs,
                             add_generation_prompt=req.add_generation_prompt,
                             continue_final_message=req.continue_final_message)


def tokenization_router(engine: AsyncLLMEngine) -> APIRouter:
    router = APIRouter()
    max_model_len = engine.engine.config.max_model_len

    def answer(req: TokenizeRequest) -> JSONResponse:  # which serializes as it is made
        tokens = tokenize(engine, req)
        strs = engine.tokenizer.convert_ids_to_tokens(tokens) if req.return_token_strs else None
        return JSONResponse({"count": len(tokens), "max_model_len": max_model_len, "tokens": tokens,
                             "token_strs": strs})

    # In a worker thread, the answer's JSON too: a long text (a million tokens fit the body limit)
    # must not hold up the event loop, and every stream's next token with it.
    @router.post("/tokenize")
    async def tokenize_endpoint(req: TokenizeRequest):
        return await asyncio.to_thread(answer, req)

    @router.post("/detokenize")
    async def detokenize_endpoint(req: DetokenizeRequest):
        vocab_size = engine.engine.vocab_size
        if bad := [t for t in req.tokens if not 0 <= t < vocab_size]:
            raise BadRequest(f"tokens {bad[:5]} are outside the model's vocabulary [0, {vocab_size})", "tokens")
        return {"prompt": await asyncio.to_thread(engine.tokenizer.decode, req.tokens)}

    return router
