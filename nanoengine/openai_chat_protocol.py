"""The chat completions API's request body: its messages (content parts, tool calls made and
answered) and its tools, on top of the fields every request shares (openai_protocol.py).

A message becomes what the chat template reads through ``ChatMessage.for_template``; tools and
``tool_choice`` are openai_tool_calls.py's to act on.
"""

import json
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from nanoengine.input_processor import text_of_parts
from nanoengine.openai_protocol import OpenAIRequest, Schema, no_op


class TextPart(Schema):
    type: Literal["text"]
    text: str
    cache_control: dict | None = None  # IGNORED


class FunctionCall(Schema):
    name: str
    arguments: str  # JSON text, as a response gives it; or not (a call cut by max_tokens), as OpenAI takes it

    def for_template(self) -> dict | str:
        """The arguments as templates read them: an object (HF's chat-template guide; vLLM does the
        same), ``{}`` for none (vLLM's reading of ``""``), and text that is not JSON as it is."""
        if not self.arguments.strip():
            return {}
        try:
            return json.loads(self.arguments)
        except ValueError:
            return self.arguments


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
    annotations: list | None = None  # IGNORED
    cache_control: dict | None = None  # IGNORED
    # An earlier reply's reasoning, sent back with it (vLLM's names): for templates that read it (Qwen3's)
    reasoning_content: str | None = None
    reasoning: str | None = None

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
        """The message as the chat template reads it: content parts joined (``text_of_parts``),
        developer as system, and a tool call's arguments as ``FunctionCall.for_template`` gives them."""
        content = self.content or ""
        text = content if isinstance(content, str) else text_of_parts([part.model_dump() for part in content])
        message = {"role": "system" if self.role == "developer" else self.role, "content": text}
        if self.tool_calls:
            message["tool_calls"] = [{"id": call.id, "type": "function", "function": {
                "name": call.function.name, "arguments": call.function.for_template()}}
                for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if (reasoning := self.reasoning_content or self.reasoning) is not None:
            message["reasoning_content"] = reasoning
        return message


class FunctionDefinition(Schema):
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]  # OpenAI's rule for a function's name
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of an object; none: the function takes no arguments
    strict: bool | None = None  # a forced call's arguments follow the schema either way; see openai_tool_calls.py

    @model_validator(mode="after")
    def rendered_as_text(self):
        """A function is written into the prompt as JSON (by the template, or openai_tool_calls.py) and its
        arguments are what ``f(**arguments)`` takes: text, and an object."""
        try:
            json.dumps(self.model_dump(exclude_none=True), ensure_ascii=False).encode()
        except UnicodeEncodeError as e:
            raise ValueError(f"must be valid Unicode text: a lone surrogate at character {e.start} of its JSON") \
                from None
        if "type" in (self.parameters or {}) and self.parameters["type"] != "object":
            raise ValueError(f"parameters must be the JSON schema of an object, got type {self.parameters['type']!r}")
        return self


class Tool(Schema):
    type: Literal["function"]
    function: FunctionDefinition
    cache_control: dict | None = None  # IGNORED


class FunctionName(Schema):
    name: str


class NamedToolChoice(Schema):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(OpenAIRequest):
    messages: list[ChatMessage]
    max_completion_tokens: Annotated[int | None, Field(ge=1)] = None  # the newer name for max_tokens
    logprobs: bool | None = None
    # with logprobs: how many top tokens' logprobs beside each sampled one (at most max_logprobs: serve.py)
    top_logprobs: Annotated[int | None, Field(ge=0)] = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: the template's variables
    documents: list[dict[str, str]] | None = None  # vLLM's: for a template that reads them (retrieval)
    chat_template: Annotated[str | None, no_op(None, why="the server's template (--chat-template) is the one run")] \
        = None
    add_special_tokens: Annotated[bool, no_op(False, why="the chat template writes the special tokens")] = False
    add_generation_prompt: bool = True  # vLLM's: false leaves the assistant's header out
    continue_final_message: bool = False  # vLLM's: the last message left open, for the model to go on with
    echo: bool = False  # vLLM's: the last message's text in front of the reply, where the reply is in its role
    # Tools (openai_tool_calls.py): none, "auto", "required" or a named function; default "auto" with tools.
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
