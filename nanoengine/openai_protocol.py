"""OpenAI's API as the server reads it and answers it: the request bodies, their translation into
``SamplingParams``, and the shapes of logprobs in a response.

The models are strict: "5" is not an integer, and a field nanoengine does not know is a 400,
never silently ignored. Some fields clients send on every request with a value that changes
nothing (``presence_penalty: 0``, a ``user`` id): those are accepted with
that value, and any other value is a 400 that says what is supported (``no_op``).

Errors, whatever raised them, reach the client as OpenAI's error body (``error_body``).
"""

import json
from itertools import accumulate
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, ValidationError, WrapValidator

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
    stop_token_ids: list[int] | None = None  # an extension, as in vLLM
    prompt_logprobs: int | None = None  # an extension, as in vLLM: each prompt token's logprob and top k
    n: int = 1
    stream: bool = False
    stream_options: dict[str, bool] | None = None  # {"include_usage": true} adds a usage chunk
    user: str | None = None  # an end-user id for OpenAI's abuse monitoring: accepted, not used
    presence_penalty: Annotated[float, no_op(0.0, why="nanoengine has no repetition penalties")] = 0.0
    frequency_penalty: Annotated[float, no_op(0.0, why="nanoengine has no repetition penalties")] = 0.0
    logit_bias: Annotated[dict[str, float] | None, no_op(None, {}, why="logits are not biased")] = None


def one_of_the_prompt_forms(value: Any, handler) -> Any:
    """One message for a prompt of none of the four forms, rather than pydantic's one per form."""
    try:
        return handler(value)
    except ValidationError:
        raise ValueError("must be a string, a list of strings, a list of token ids or a list of token-id lists") \
            from None


class CompletionRequest(OpenAIRequest):
    # OpenAI's four forms: one prompt (text or token ids) or a batch of them, answered together.
    prompt: Annotated[str | list[str] | list[int] | list[list[int]], WrapValidator(one_of_the_prompt_forms)]
    logprobs: int | None = None  # how many top tokens' logprobs to return beside each sampled one
    echo: bool = False  # the prompt in front of each choice's text (and its tokens' logprobs, with logprobs)
    best_of: Annotated[int | None, no_op(None, 1, why="n completions are sampled, not best_of")] = None


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
    logprobs: bool | None = None
    top_logprobs: int | None = None  # with logprobs: how many top tokens' logprobs beside each sampled one


def sampling_params(req: OpenAIRequest, max_tokens: int, logprobs: int | None) -> SamplingParams:
    return SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, seed=req.seed,
                          ignore_eos=req.ignore_eos, max_tokens=max_tokens, n=req.n, logprobs=logprobs,
                          stop=req.stop, stop_token_ids=req.stop_token_ids)


def completion_logprobs(tokenizer, logprobs: list[dict[int, float | None]], offset: int) -> dict:
    """The completions API's shape: each token's text and logprob, its top alternatives by text,
    and where each token's text starts (``offset``: the length of the choice's text before them).
    An echoed prompt's first token has no logprob (nothing before it predicts it): its entry is
    ``{token_id: None}``, and its logprob and top alternatives are null."""
    tokens = [tokenizer.decode([next(iter(top))]) for top in logprobs]
    starts = list(accumulate(map(len, tokens), initial=offset))[:-1]
    token_logprobs = [next(iter(top.values())) for top in logprobs]
    return {"tokens": tokens, "token_logprobs": token_logprobs,
            "top_logprobs": [None if lp is None else {tokenizer.decode([t]): v for t, v in top.items()}
                             for top, lp in zip(logprobs, token_logprobs)],
            "text_offset": starts}


def chat_logprobs(tokenizer, logprobs: list[dict[int, float]], num_top: int) -> dict:
    """The chat API's shape: per token its text, bytes, logprob and its ``num_top`` best alternatives."""
    def entry(token_id: int, logprob: float) -> dict:
        text = tokenizer.decode([token_id])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
    return {"content": [{**entry(*next(iter(top.items()))),
                         "top_logprobs": [entry(*item) for item in sorted(top.items(), key=lambda x: -x[1])[:num_top]]}
                        for top in logprobs]}
