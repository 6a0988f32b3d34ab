"""OpenAI's Responses API as the server reads it: the body of ``POST /v1/responses`` and its
translation into a chat completions request, so that one request policy (openai_chat_protocol.py
and serve.py's chat endpoint) checks and serves both APIs.

A Responses request is a conversation of items (messages of text parts, the function calls a reply
made and their outputs) after ``instructions``, with chat's settings under other names:
``max_output_tokens`` is ``max_completion_tokens``, a function tool is flat where chat nests it
under ``"function"``, ``text.format`` is ``response_format``. ``chat_request`` turns one into the
other, an earlier response's items (``previous_response_id``) first; what the chat model refuses
is a 400 in the Responses API's names (``in_responses_terms``). Fields of this API only are
honoured (``store``, ``metadata``, ``include``'s logprobs: serve_responses.py), ignored as they
change nothing here (``IGNORED``), or refused with a 400 that says why: what needs OpenAI's own
servers (built-in tools, stored prompts, conversations, background runs).
"""

import logging
import re
from typing import Annotated, Any, Literal

from pydantic import (BeforeValidator, Discriminator, Field, Tag, TypeAdapter, ValidationError, field_validator,
                      model_validator)

from nanoengine.serve_limits import validation_message
from nanoengine.openai_chat_protocol import ChatCompletionRequest, FunctionDefinition
from nanoengine.openai_protocol import BadRequest, Schema, as_sampling_params_take_it, no_op

logger = logging.getLogger(__name__)

# Accepted and not used, and why each cannot change the output here (the chat API's own, such as
# ``user`` and ``prompt_cache_key``, go on to the chat request, whose IGNORED says why).
IGNORED = {
    "stream_options": "include_obfuscation pads events against a network side channel; none are padded here",
    "reasoning": "its effort is the chat API's reasoning_effort; no reasoning is produced, so none is summarized",
}
BUILT_IN = "built-in tools run on OpenAI's servers; function tools, which the client runs, are served"


def _only(kinds: tuple[str, ...], what: str, why: str, default: str | None = None) -> BeforeValidator:
    """A before-validator that refuses an object, or a list's, whose ``type`` (``default`` if none)
    is not one of ``kinds``, naming the type and why, rather than pydantic's error per shape tried."""
    def check(value: Any) -> Any:
        for i, each in enumerate(value if isinstance(value, list) else [value]):
            if (kind := each.get("type", default) if isinstance(each, dict) else None) not in (*kinds, None):
                name = f"{what} {i}" if isinstance(value, list) else what
                raise ValueError(f"{name} of type {kind!r} is not served here: {why}")
        return value
    return BeforeValidator(check)


class TextPart(Schema):
    type: Literal["input_text", "output_text"]  # output_text: an earlier response's, sent back
    text: str
    annotations: list | None = None  # an earlier response's, ignored as chat ignores a message's
    logprobs: list | None = None  # an earlier response's, ignored


def _text_or(items: Any) -> Any:
    """A string or a list of ``items``, told apart by its type, so that a bad list is one error, not
    also the string's (the location names the form: ``text`` or ``list``)."""
    return Annotated[Annotated[str, Tag("text")] | Annotated[list[items], Tag("list")],
                     Discriminator(lambda v: "text" if isinstance(v, str) else "list")]


Text = Annotated[_text_or(TextPart), _only(("input_text", "output_text"), "part", "the served model reads text")]


class Item(Schema):
    """What an item carries when it is an earlier response's, sent back."""
    id: str | None = None
    status: str | None = None


class Message(Item):
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: Text
    phase: str | None = None  # "commentary" or "final_answer", an earlier reply's: the template reads neither


class FunctionCall(Item):
    """A call an earlier response made."""
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutput(Item):
    """What the client's function returned, for the call ``call_id``."""
    type: Literal["function_call_output"]
    call_id: str
    output: Text


InputItem = Annotated[Annotated[Message, Tag("message")] | Annotated[FunctionCall, Tag("function_call")]
                      | Annotated[FunctionCallOutput, Tag("function_call_output")],
                      Discriminator(lambda v: v.get("type", "message") if isinstance(v, dict) else v.type)]
ITEM_LIST = TypeAdapter(list[InputItem])


class FunctionTool(FunctionDefinition):
    """A function tool, flat: chat's ``FunctionDefinition`` (its checks) with the ``type`` beside it."""
    type: Literal["function"]


class FunctionChoice(Schema):
    type: Literal["function"]
    name: str


class TextFormat(Schema):
    """``text.format``: chat's ``response_format`` with the JSON schema's fields beside ``type``."""
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")  # pydantic's BaseModel has a ``schema`` of its own
    strict: bool | None = None

    def response_format(self) -> dict:
        if self.type != "json_schema":
            return {"type": self.type}
        return {"type": "json_schema", "json_schema": self.model_dump(by_alias=True, exclude={"type"},
                                                                      exclude_none=True)}


class TextConfig(Schema):
    format: TextFormat | None = None
    verbosity: str | None = None  # chat's verbosity, which only "medium" passes


class Reasoning(Schema):
    effort: str | None = None  # chat's reasoning_effort
    summary: str | None = None  # IGNORED
    generate_summary: str | None = None  # IGNORED (its older name)


class ResponsesRequest(Schema):
    model: str | None = None  # one model is served; the name is echoed back
    input: Annotated[_text_or(InputItem), _only(("message", "function_call", "function_call_output"), "item",
                                                "items are messages, function calls and their outputs", "message")]
    instructions: str | None = None  # a system message in front; not carried on by previous_response_id
    previous_response_id: str | None = None
    store: bool | None = None  # null: true, OpenAI's default
    metadata: dict[str, str] | None = None  # echoed, and kept with the stored response
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    _sampling_fields = field_validator("temperature", "top_p")(as_sampling_params_take_it)  # named with type errors
    include: list[Literal["message.output_text.logprobs", "reasoning.encrypted_content", "file_search_call.results",
                          "web_search_call.results", "web_search_call.action.sources", "message.input_image.image_url",
                          "computer_call_output.output.image_url", "code_interpreter_call.outputs"]] | None = None
    tools: Annotated[list[FunctionTool] | None, _only(("function",), "tool", BUILT_IN)] = None
    tool_choice: Annotated[Literal["none", "auto", "required"] | FunctionChoice | None,
                           _only(("function",), "a choice", 'only "none", "auto", "required" and a named '
                                 'function ({"type": "function", "name": ...}) are served')] = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: Reasoning | None = None
    stream: bool | None = None
    stream_options: dict[str, bool] | None = None
    # The chat API's, passed on to it: its IGNORED says why none changes the output.
    user: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict | None = None
    # What needs OpenAI's own servers.
    truncation: Annotated[str | None, no_op(None, "disabled", why="a conversation longer than the context is "
                                            "refused, not cut (max_model_len)")] = None
    background: Annotated[bool | None, no_op(None, False, why="a response is generated while its request is "
                                             "open")] = None
    conversation: Annotated[str | dict | None, no_op(None, why="there is no Conversations API: continue with "
                                                     "previous_response_id")] = None
    context_management: Annotated[list | None, no_op(None, why="nothing compacts a conversation here")] = None
    max_tool_calls: Annotated[int | None, no_op(None, why="the calls a reply makes are not bounded by count "
                                                "(parallel_tool_calls: false allows one)")] = None
    prompt: Annotated[dict | None, no_op(None, why="there are no stored prompt templates")] = None

    @model_validator(mode="after")
    def log_ignored(self):  # in place of Schema's: metadata and store are honoured here
        if ignored := sorted(self.model_fields_set & IGNORED.keys()):
            logger.debug("ResponsesRequest: ignored %s", ", ".join(f"{f} ({IGNORED[f]})" for f in ignored))
        return self

    @property
    def input_items(self) -> list:
        return [Message(role="user", content=self.input)] if isinstance(self.input, str) else self.input

    @property
    def logprobs(self) -> bool:
        return "message.output_text.logprobs" in (self.include or []) or self.top_logprobs is not None


def chat_messages(items: list) -> list[dict]:
    """The conversation as chat messages: a function call joins the assistant message before it
    (calls made together are one message), its output is a tool message."""
    def content(value: str | list[TextPart]) -> str | list[dict]:
        return value if isinstance(value, str) else [{"type": "text", "text": part.text} for part in value]
    messages = []
    for item in items:
        if isinstance(item, Message):
            messages.append({"role": item.role, "content": content(item.content)})
        elif isinstance(item, FunctionCall):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1]["tool_calls"] = [*messages[-1].get("tool_calls", []), call]
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": content(item.output)})
    return messages


def chat_request(req: ResponsesRequest, earlier: list[dict]) -> ChatCompletionRequest:
    """The chat request that serves ``req``: ``instructions``, the ``earlier`` items (an earlier
    response's input and output, as stored), then ``req``'s input. Usage is always streamed, as
    the Responses API's last event carries it."""
    system = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
    choice = req.tool_choice
    body = {
        "messages": system + chat_messages(ITEM_LIST.validate_python(earlier) + req.input_items),
        "max_completion_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p,
        "tools": [{"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
                  for tool in req.tools] if req.tools else None,
        "tool_choice": {"type": "function", "function": {"name": choice.name}} if isinstance(choice, FunctionChoice)
        else choice,
        "parallel_tool_calls": req.parallel_tool_calls,
        "response_format": req.text.format.response_format() if req.text and req.text.format else None,
        "verbosity": req.text.verbosity if req.text else None,
        "reasoning_effort": req.reasoning.effort if req.reasoning else None,
        "logprobs": req.logprobs or None, "top_logprobs": req.top_logprobs,
        "stream": bool(req.stream), "stream_options": {"include_usage": True} if req.stream else None,
        **req.model_dump(include={"user", "safety_identifier", "service_tier", "prompt_cache_key",
                                  "prompt_cache_retention", "prompt_cache_options"}),
    }
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as e:
        named = [validation_message(error) for error in e.errors()]
        raise in_responses_terms(BadRequest("; ".join(m for m, _ in named), named[0][1])) from None


# Chat's names for what the Responses API names otherwise; longest first, so each matches whole.
RESPONSES_NAMES = {"response_format.json_schema.schema": "text.format.schema", "response_format.json_schema":
                   "text.format", "response_format": "text.format", "max_completion_tokens": "max_output_tokens",
                   "messages": "input", "reasoning_effort": "reasoning.effort", "verbosity": "text.verbosity"}
CHAT_NAME = re.compile(r"\b(" + "|".join(map(re.escape, RESPONSES_NAMES)) + r")\b|\b(tools\.\d+)\.function\b")


def in_responses_terms(error: BadRequest) -> BadRequest:
    """A chat request's 400 in the Responses API's names: its message and ``param``."""
    def rename(text: str) -> str:
        return CHAT_NAME.sub(lambda m: RESPONSES_NAMES[m[1]] if m[1] else m[2], text)
    return BadRequest(rename(str(error)), error.param and rename(error.param))
