"""OpenAI's ``/v1/embeddings``: a vector per input, from a server started with ``--runner pooling``
(vLLM's flag; pooler.py pools the hidden states as the model says).

The fields are OpenAI's: ``input`` is a string, a list of strings, a list of token ids or a list of
those (at most ``MAX_INPUTS``, OpenAI's bound), each within ``max_model_len`` tokens or cut to its
last ``truncate_prompt_tokens`` (vLLM's extension, as the completions endpoint takes it);
``encoding_format`` is ``float`` (lists of numbers) or ``base64`` (each vector's float32 bytes,
little-endian, as OpenAI sends them; the openai SDK asks for it unless told otherwise);
``dimensions`` keeps a Matryoshka model's first dimensions, and is refused for any other model;
``user`` is accepted and unused. The answer is OpenAI's list, with ``usage`` counting the inputs'
tokens. A server started to generate answers a 400 that says how to start one that embeds, as a
pooling server answers completions and chat (engine.py refuses them).
"""

import asyncio
import base64
from typing import Annotated, Any, Literal

import torch
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import WrapValidator, model_validator

from nanoengine.serve_async_engine import AsyncLLMEngine
from nanoengine.openai_protocol import BadRequest, Schema, one_of_the_prompt_forms
from nanoengine.serve_completions import unless_disconnected
from nanoengine.pooler import PoolingParams

MAX_INPUTS = 2048  # OpenAI's bound on one request's inputs: each becomes a request of its own


class EmbeddingRequest(Schema):
    model: str | None = None  # one model is served; the name is echoed back
    input: Annotated[str | list[str] | list[int] | list[list[int]], WrapValidator(one_of_the_prompt_forms)]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None  # IGNORED
    truncate_prompt_tokens: int | None = None  # vLLM's: each input's last k tokens (-1: max_model_len)
    add_special_tokens: bool = True  # vLLM's: a text input's BOS and the like, as the tokenizer adds them

    @model_validator(mode="before")
    @classmethod
    def null_is_the_default(cls, data: Any) -> Any:
        """A null field means its default, as in OpenAI's API (and ``OpenAIRequest``'s)."""
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


def encode(vector: torch.Tensor, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode()
    return vector.tolist()


def embeddings_router(engine: AsyncLLMEngine, model_name: str) -> APIRouter:
    router = APIRouter()
    config = engine.engine.config

    def check(req: EmbeddingRequest) -> tuple[list[str | list[int]], PoolingParams]:
        """The request's inputs and its ``PoolingParams``, or a 400 naming the field at fault."""
        if config.runner != "pooling":
            raise BadRequest("this server generates text: embeddings need a pooling runner, so start it with "
                             "--runner pooling")
        inputs = [req.input] if isinstance(req.input, str) or (req.input and isinstance(req.input[0], int)) \
            else req.input
        if not inputs or len(inputs) > MAX_INPUTS:
            raise BadRequest(f"input must hold 1 to {MAX_INPUTS} inputs, got {len(inputs)}", "input")
        if (k := req.truncate_prompt_tokens) is not None and not (k == -1 or 1 <= k <= config.max_model_len):
            raise BadRequest(f"truncate_prompt_tokens must be -1 (max_model_len) or an integer in [1, "
                             f"max_model_len={config.max_model_len}], got {k}", "truncate_prompt_tokens")
        try:
            params = PoolingParams(req.dimensions, req.truncate_prompt_tokens)
            engine.engine.check_pooling_params(params)  # reads only what the engine was built with
        except ValueError as e:
            raise BadRequest(str(e), "dimensions") from None
        return inputs, params

    def tokenize(inputs: list[str | list[int]], params: PoolingParams, add_special_tokens: bool) -> list[list[int]]:
        def one(index: int, prompt: str | list[int]) -> list[int]:
            try:
                return engine.tokenize(prompt, params.truncate_prompt_tokens, add_special_tokens)
            except ValueError as e:  # too long, empty, outside the vocabulary
                raise BadRequest(f"input[{index}]: {e}" if len(inputs) > 1 else f"input: {e}", "input") from None
        return [one(i, prompt) for i, prompt in enumerate(inputs)]

    def answer(vectors: list[torch.Tensor], prompt_ids: list[list[int]], encoding_format: str) -> JSONResponse:
        num_tokens = sum(map(len, prompt_ids))
        return JSONResponse({"object": "list", "model": model_name,
                             "data": [{"object": "embedding", "index": i, "embedding": encode(v, encoding_format)}
                                      for i, v in enumerate(vectors)],
                             "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}})

    # Tokenizing and the answer's JSON (a few MB for a large batch) run in worker threads: on the
    # event loop they would hold up every other request.
    @router.post("/v1/embeddings")
    async def embeddings(req: EmbeddingRequest, request: Request):
        inputs, params = check(req)
        prompt_ids = await asyncio.to_thread(tokenize, inputs, params, req.add_special_tokens)

        async def embed() -> JSONResponse:
            stream = await engine.add_requests(prompt_ids, params)
            vectors = [None] * len(prompt_ids)
            try:
                async for output in stream:
                    vectors[output.index] = output.pooled
            finally:
                stream.abort()  # the client went away, or the step failed: nothing is left queued
            return await asyncio.to_thread(answer, vectors, prompt_ids, req.encoding_format)
        return await unless_disconnected(request, embed())

    return router
