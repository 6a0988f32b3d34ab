"""OpenAI's API as the server reads it and answers it: the request bodies, their translation into
``SamplingParams``, and the shapes of logprobs in a response.

Every field of OpenAI's chat and completions APIs is declared, so none is a surprise: it is
honoured; or accepted and ignored, because it cannot change the output here (``IGNORED``, the
table in docs/serving.md; a request that sets one logs it at debug level); or, for
a value that would change the output and that nanoengine cannot give, refused with a 400 that
says why (``no_op``: ``modalities: ["audio"]``). vLLM's extensions are declared beside them. The
models are strict: "5" is not an integer, and a field that neither API knows is a 400.

Errors, whatever raised them, reach the client as OpenAI's error body (``error_body``).
"""

import json
import logging
from itertools import accumulate
from typing import Annotated, Any, Literal

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, WrapValidator,
                      field_validator, model_validator)

from nanoengine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Accepted and not used, and why each cannot change the output here.
IGNORED = {
    "metadata": "tags for OpenAI's stored completions; nothing is stored",
    "store": "nothing is stored",
    "service_tier": "one tier serves every request",
    "user": "an end-user id for OpenAI's abuse monitoring",
    "safety_identifier": "an end-user id for OpenAI's abuse monitoring",
    "prompt_cache_key": "the prefix cache finds shared prompts by their tokens",
    "prompt_cache_retention": "the prefix cache keeps blocks until they are reused",
    "prompt_cache_options": "the prefix cache finds shared prompts by their tokens",
    "reasoning_effort": "the served model has no reasoning effort to set",
    "modalities": 'only ["text"] is accepted: text is what is generated',
    "prediction": "predicted output only saves time; the tokens are the same without it",
    "name": "a message's author name, which the chat template does not read",
}


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


def _token_ids(bias: dict[str, float] | None) -> dict[str, float] | None:
    """OpenAI's logit_bias: token ids written as strings, biases in [-100, 100]."""
    for token, value in (bias or {}).items():
        if not token.isdigit():
            raise ValueError(f"keys must be token ids, got {token!r}")
        if not -100 <= value <= 100:
            raise ValueError(f"biases must be in [-100, 100], got {value} for token {token}")
    return bias


class Schema(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    @model_validator(mode="after")
    def log_ignored(self):
        if ignored := sorted(self.model_fields_set & IGNORED.keys()):
            logger.debug("%s: ignored %s", type(self).__name__, ", ".join(f"{f} ({IGNORED[f]})" for f in ignored))
        return self


class JsonSchema(Schema):
    """``response_format.json_schema``: strict or not, the schema is enforced (structured_output.py)."""
    name: str
    description: str | None = None
    schema_: dict = Field(alias="schema")  # pydantic's BaseModel has a ``schema`` of its own
    strict: bool | None = None


class ResponseFormat(Schema):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None

    @model_validator(mode="after")
    def json_schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('json_schema is given with type "json_schema", and only then')
        return self


class StructuredOutputs(Schema):
    """vLLM's ``structured_outputs`` extension: ``StructuredOutputsParams``' fields (exactly one)."""
    json_: dict | str | None = Field(None, alias="json")  # pydantic's BaseModel has a ``json`` of its own
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class OpenAIRequest(Schema):
    model: str | None = None  # one model is served; the name is echoed back
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: dict[str, bool] | None = None  # {"include_usage": true} adds a usage chunk
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Annotated[dict[str, float] | None, AfterValidator(_token_ids)] = None
    user: str | None = None
    # vLLM's extensions (the openai client sends them through ``extra_body``)
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None  # each prompt token's logprob and its top k
    # What the output must follow (openai_structured.py): OpenAI's response_format (on completions
    # too, as in vLLM), vLLM's structured_outputs, and its older guided_* names. One at most.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @field_validator("temperature", "top_p", "n", "stream", "presence_penalty", "frequency_penalty", mode="before")
    @classmethod
    def null_is_the_default(cls, value: Any, info: ValidationInfo) -> Any:
        """OpenAI's API takes null for these, meaning the default, and some clients send it."""
        return cls.model_fields[info.field_name].default if value is None else value


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
    suffix: Annotated[str | None, no_op(None, why="there is no fill-in-the-middle")] = None


class TextPart(Schema):
    type: Literal["text"]
    text: str


def _json_text(text: str) -> str:
    try:
        json.loads(text)
    except ValueError as e:
        raise ValueError(f"must be JSON text: {e}") from None
    return text


class FunctionCall(Schema):
    name: str
    arguments: Annotated[str, AfterValidator(_json_text)]  # JSON text, as a response gives it


class ToolCall(Schema):
    """A call an assistant message made, as a response gave it and a client sends it back."""
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(Schema):
    role: Literal["system", "developer", "user", "assistant", "tool"]  # developer: OpenAI's newer name for system
    content: str | list[TextPart] | None = None  # None only in an assistant message with tool_calls
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant message's
    tool_call_id: str | None = None  # a tool message's: the call it answers
    # What an assistant message of an earlier response holds when a client sends it back.
    refusal: Annotated[str | None, no_op(None, why="a refusal cannot be written into the chat template")] = None
    function_call: Annotated[dict | None, no_op(None, why="functions are deprecated: use tools")] = None
    audio: Annotated[dict | None, no_op(None, why="only text is generated")] = None

    @model_validator(mode="after")
    def fields_of_its_role(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required, except in an assistant message with tool_calls")
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"tool_calls are an assistant message's, not a {self.role} message's")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("tool_call_id is required in a tool message, and only there")
        return self

    def for_template(self) -> dict:
        """The message as the chat template reads it: content parts joined by newlines, as vLLM
        does, developer as system, and a tool call's arguments as an object (what templates, and
        HF's chat-template guide, expect; vLLM does the same)."""
        content = self.content or ""
        text = content if isinstance(content, str) else "\n".join(part.text for part in content)
        message = {"role": "system" if self.role == "developer" else self.role, "content": text}
        if self.tool_calls:
            message["tool_calls"] = [{"id": call.id, "type": "function", "function": {
                "name": call.function.name, "arguments": json.loads(call.function.arguments)}}
                for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class FunctionDefinition(Schema):
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]  # OpenAI's rule for a function's name
    description: str | None = None
    parameters: dict | None = None  # a JSON schema; none: the function takes no arguments
    strict: bool | None = None  # strict or not, a forced call's arguments follow the schema


class Tool(Schema):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(Schema):
    name: str


class NamedToolChoice(Schema):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(OpenAIRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # the newer name for max_tokens
    logprobs: bool | None = None
    top_logprobs: int | None = None  # with logprobs: how many top tokens' logprobs beside each sampled one
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: the template's variables
    # Tools (tool_calls.py): none, "auto", "required" or a named function; default "auto" with tools.
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # false: at most one call
    functions: Annotated[list | None, no_op(None, [], why="functions are deprecated: use tools")] = None
    function_call: Annotated[str | dict | None, no_op(None, "none", "auto",
                                                      why="functions are deprecated: use tools")] = None
    modalities: Annotated[list[str] | None, no_op(None, ["text"], why="only text is generated")] = None
    audio: Annotated[dict | None, no_op(None, why="only text is generated")] = None
    web_search_options: Annotated[dict | None, no_op(None, why="there is no web search")] = None
    verbosity: Annotated[str | None, no_op(None, "medium", why="the model's verbosity cannot be set")] = None
    moderation: Annotated[dict | None, no_op(None, why="there is no moderation")] = None
    reasoning_effort: str | None = None
    prediction: dict | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict | None = None


def sampling_params(req: OpenAIRequest, max_tokens: int, logprobs: int | None) -> SamplingParams:
    return SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, seed=req.seed,
                          ignore_eos=req.ignore_eos, max_tokens=max_tokens, n=req.n, logprobs=logprobs,
                          stop=req.stop, stop_token_ids=req.stop_token_ids, presence_penalty=req.presence_penalty,
                          frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty,
                          min_p=req.min_p, min_tokens=req.min_tokens,
                          logit_bias={int(t): b for t, b in (req.logit_bias or {}).items()})


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
