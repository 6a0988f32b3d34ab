"""OpenAI's API as the server reads it: the request bodies, and their translation into ``SamplingParams``.

The models are strict: "5" is not an integer, and a field nanoengine does not know is a 400,
never silently ignored. Some fields clients send on every request with a value that changes
nothing (``presence_penalty: 0``, ``logprobs: false``, a ``user`` id): those are accepted with
that value, and any other value is a 400 that says what is supported (``no_op``).

Errors, whatever raised them, reach the client as OpenAI's error body (``error_body``).
"""

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict

from nanoengine.sampling_params import SamplingParams


class BadRequest(ValueError):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def error_body(message: str, error_type: str = "invalid_request_error", param: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": None}}


def no_op(*unchanged: Any, why: str) -> AfterValidator:
    """Accept a field only with a value that changes nothing; ``why`` says why others are refused.

    Compared by type as well as value, since ``0 == False`` in Python: ``logprobs: 0`` asks for
    the chosen tokens' logprobs, ``logprobs: false`` for none.
    """
    def check(value: Any) -> Any:
        if not any(type(value) is type(u) and value == u for u in unchanged):
            raise ValueError(f"only {' or '.join(map(json.dumps, unchanged))} is supported: {why}")
        return value
    return AfterValidator(check)


class OpenAIRequest(BaseModel):
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
    user: str | None = None  # an end-user id for OpenAI's abuse monitoring: accepted, not used
    presence_penalty: Annotated[float, no_op(0.0, why="nanoengine has no repetition penalties")] = 0.0
    frequency_penalty: Annotated[float, no_op(0.0, why="nanoengine has no repetition penalties")] = 0.0
    logit_bias: Annotated[dict[str, float] | None, no_op(None, {}, why="logits are not biased")] = None
    logprobs: Annotated[bool | int | None, no_op(None, False, why="logprobs are not returned")] = None


class CompletionRequest(OpenAIRequest):
    prompt: str | list[int]
    echo: Annotated[bool, no_op(False, why="the prompt is not echoed")] = False
    best_of: Annotated[int | None, no_op(None, 1, why="one completion is sampled per request")] = None


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]

    @property
    def text(self) -> str:
        """The content as one string, for the chat template: text parts joined by newlines, as vLLM does."""
        return self.content if isinstance(self.content, str) else "\n".join(part.text for part in self.content)


class ChatCompletionRequest(OpenAIRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # the newer name for max_tokens


def sampling_params(req: OpenAIRequest, max_tokens: int) -> SamplingParams:
    if req.n != 1:
        raise BadRequest(f"n must be 1 (only one completion per request is supported), got {req.n}", "n")
    if isinstance(req.stop, list) and not all(req.stop) or req.stop == "":
        raise BadRequest("stop strings must not be empty", "stop")
    return SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, seed=req.seed,
                          ignore_eos=req.ignore_eos, max_tokens=max_tokens)
