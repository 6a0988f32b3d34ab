"""OpenAI's API as the server reads it: the request bodies (the chat API's messages and tools in
openai_chat_protocol.py) and their translation into ``SamplingParams``.

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
    "annotations": "an earlier response's URL citations, sent back with its message; the template reads none",
    "cache_control": "a prompt-caching hint (Anthropic's, passed on by LiteLLM and LangChain); the prefix cache "
                     "finds shared prompts by their tokens",
    "length_penalty": "vLLM's, for its served beam search, which use_beam_search cannot turn on here",
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
        if not (token.isascii() and token.isdigit()):  # str.isdigit alone takes "²", which int() refuses
            raise ValueError(f"keys must be token ids, got {token!r}")
        if not -100 <= value <= 100:
            raise ValueError(f"biases must be in [-100, 100], got {value} for token {token}")
    return bias


def _unicode(text: str | None) -> str | None:
    """A string sent back in the response (JSON escapes a lone surrogate, and strict parsers refuse it)."""
    if text is not None:
        try:
            text.encode()
        except UnicodeEncodeError as e:
            raise ValueError(f"must be valid Unicode text: a lone surrogate at character {e.start}") from None
    return text


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


def as_sampling_params_take_it(value: Any, info: ValidationInfo) -> Any:
    """A field ``SamplingParams`` takes as it is, checked by its rule for that field alone (a field
    validator of the request models): a body's range errors then come in one 400 with its type
    errors, every bad field named, rather than one at a time from the ``SamplingParams`` made later.
    (Rules across fields, as min_tokens <= max_tokens, and the engine's limits, as max_logprobs, are
    checked then.)"""
    SamplingParams(**{info.field_name: value})
    return value


class OpenAIRequest(Schema):
    model: str | None = None  # one model is served; the name is echoed back
    max_tokens: Annotated[int | None, Field(ge=0)] = None  # 0: the prompt only, echoed (completions)
    temperature: float = 1.0
    top_p: float = 1.0
    seed: Annotated[int | None, Field(ge=-2**63, lt=2**64)] = None  # vLLM's bounds: what a 64-bit seed holds
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
    min_tokens: Annotated[int, Field(ge=0)] = 0  # and at most max_tokens: SamplingParams checks the two
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # as vLLM with a fast tokenizer: special tokens as they are
    truncate_prompt_tokens: int | None = None  # the prompt's last k tokens (-1: max_model_len)
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None  # each prompt token's logprob and its top k
    return_tokens_as_token_ids: bool = False  # logprobs' tokens as "token_id:{id}" (texts can collide)
    # the response's id ("cmpl-{request_id}"); a random one without
    request_id: Annotated[str | None, AfterValidator(_unicode)] = None
    priority: Annotated[int, no_op(0, why="requests are served first come, first served")] = 0
    use_beam_search: Annotated[bool, no_op(False, why="beam search is offline only: LLM.beam_search")] = False
    length_penalty: float = 1.0  # IGNORED
    # What the output must follow (openai_structured.py): OpenAI's response_format (on completions
    # too, as in vLLM), vLLM's structured_outputs, and its older guided_* names. One at most.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @model_validator(mode="before")
    @classmethod
    def null_is_the_default(cls, data: Any) -> Any:
        """OpenAI's API takes null for an optional field, meaning its default, and clients send it
        (the openai SDK's ``echo=None``; vLLM's extensions, optional there, as ``extra_body={"top_k":
        None}``): a null is dropped wherever the default is not null itself."""
        if not isinstance(data, dict):
            return data
        return {k: v for k, v in data.items() if v is not None or k not in cls.model_fields
                or cls.model_fields[k].default is None}

    _sampling_fields = field_validator(
        "temperature", "top_p", "top_k", "n", "stop", "stop_token_ids", "presence_penalty", "frequency_penalty",
        "repetition_penalty", "min_p", "allowed_token_ids", "bad_words", "prompt_logprobs",
        "truncate_prompt_tokens")(as_sampling_params_take_it)

    @field_validator("stream_options")
    @classmethod
    def only_with_stream(cls, value: dict | None, info: ValidationInfo) -> dict | None:
        if value is not None and not info.data.get("stream"):  # as vLLM and OpenAI refuse it
            raise ValueError("only with stream: true")
        return value


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
    logprobs: Annotated[int | None, Field(ge=0)] = None  # how many top tokens' logprobs beside each sampled one
    echo: bool = False  # the prompt in front of each choice's text (and its tokens' logprobs, with logprobs)
    add_special_tokens: bool = True  # vLLM's: a text prompt's BOS and the like, as the tokenizer adds them
    best_of: Annotated[int | None, no_op(None, 1, why="n completions are sampled, not best_of")] = None
    suffix: Annotated[str | None, no_op(None, why="there is no fill-in-the-middle")] = None


def sampling_params(req: OpenAIRequest, max_tokens: int, logprobs: int | None) -> SamplingParams:
    return SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, seed=req.seed,
                          ignore_eos=req.ignore_eos, max_tokens=max_tokens, n=req.n, logprobs=logprobs,
                          stop=req.stop, stop_token_ids=req.stop_token_ids, presence_penalty=req.presence_penalty,
                          frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty,
                          min_p=req.min_p, min_tokens=req.min_tokens,
                          logit_bias={int(t): b for t, b in (req.logit_bias or {}).items()},
                          allowed_token_ids=req.allowed_token_ids, bad_words=req.bad_words,
                          include_stop_str_in_output=req.include_stop_str_in_output,
                          skip_special_tokens=req.skip_special_tokens,
                          spaces_between_special_tokens=req.spaces_between_special_tokens,
                          truncate_prompt_tokens=req.truncate_prompt_tokens)
