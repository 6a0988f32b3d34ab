"""Tools in the chat API: what a request's ``tools`` and ``tool_choice`` ask of the model, and the
grammar that makes it call one.

- ``"none"`` (the default without tools): the tools are not rendered and nothing is parsed, so the
  model cannot call one.
- ``"auto"`` (the default with tools): the chat template renders the tools into the prompt, the
  model writes freely, and the tool parser (openai_tool_parser.py) finds the calls it made.
- ``"required"`` and a named function: ``tool_call_grammar`` makes the output one or more calls
  (one with a named function, or with ``parallel_tool_calls: false``), in the format the parser
  reads, each call's name one of the tools' and its arguments valid for that function's
  ``parameters`` schema. This holds whatever the template does with the tools.

A template that ignores tools (it renders the same prompt without them: the default SmolLM2-135M's)
would leave the model unaware of them, and every agent framework sends ``"auto"``. So there the
tools go into the system message instead, with how to call one in the format the parser reads
(``tools_in_system_message``), as llama.cpp does for such templates; earlier calls in the
conversation are written in that format too.

serve.py renders the prompt through ``ToolChoice.chat_prompt`` and hands ``grammar`` to
openai_structured.py, which compiles it as any other constraint.
"""

import json
from dataclasses import dataclass

from nanoengine.serve_async_engine import AsyncLLMEngine
from nanoengine.openai_chat_protocol import ChatCompletionRequest
from nanoengine.openai_protocol import BadRequest
from nanoengine.structured_output import closed_objects
from nanoengine.openai_tool_parser import END, START, ToolCallParser


def tool_call_grammar(tools: list[dict], parallel: bool) -> str:
    """A Lark grammar (llguidance's, JSON schemas inline) whose sentences are one call, or several
    (``parallel``) a line apart, in Hermes's format, of one of ``tools`` (OpenAI's function tools).

    A function without ``parameters`` takes none, as in OpenAI's API: its arguments are ``{}``. The
    arguments are compact JSON, as is all JSON the engine constrains, with no property the schema
    does not declare unless it allows them (structured_output.py's ``closed_objects``).
    """
    tail = json.dumps("}\n" + END)  # Lark's string literals escape as JSON's

    def call(function: dict) -> str:
        head = json.dumps(f'{START}\n{{"name": {json.dumps(function["name"])}, "arguments": ')
        return f"{head} %json {json.dumps(arguments_schema(function))} {tail}"
    repeat = ' ("\\n" call)*' if parallel else ""
    return f"start: call{repeat}\ncall: " + " | ".join(call(tool["function"]) for tool in tools)


def arguments_schema(function: dict) -> dict:
    """The JSON schema a call's arguments follow: the function's ``parameters`` (none, or an object
    schema that declares no properties: ``{}``), closed as ``closed_objects`` closes them. Unless the
    function is ``strict``, keywords llguidance lacks (``uniqueItems``, a pydantic ``set``) are
    ignored rather than refused, as for ``response_format``."""
    schema = function.get("parameters") or {"type": "object"}
    if schema.get("type") == "object" and not schema.keys() & {"properties", "additionalProperties",
                                                                 "patternProperties"}:
        schema = {**schema, "properties": {}}
    return {**json.loads(closed_objects(json.dumps(schema))),
            "x-guidance": {"whitespace_flexible": False, "lenient": not function.get("strict")}}


@dataclass
class ToolChoice:
    """What one chat request's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` ask for."""

    tools: list[dict]  # OpenAI's function tools, for the chat template; empty with "none"
    choice: str  # "none", "auto", "required" or "function" (a named one)
    forced: list[dict]  # what a call must be of: every tool for "required", the named one
    parallel: bool

    @classmethod
    def of(cls, req: ChatCompletionRequest) -> "ToolChoice":
        """The request's tools and choice, checked: a 400 names what does not fit."""
        tools = [tool.model_dump(exclude_none=True) for tool in req.tools or []]
        choice = req.tool_choice or ("auto" if tools else "none")
        if choice != "none" and not tools:
            raise BadRequest("tool_choice other than \"none\" needs tools", "tool_choice")
        if isinstance(choice, str):
            return cls(tools if choice != "none" else [], choice, tools if choice == "required" else [],
                       req.parallel_tool_calls is not False)
        named = [tool for tool in tools if tool["function"]["name"] == choice.function.name]
        if not named:
            raise BadRequest(f"tool_choice names {choice.function.name!r}, which is not one of the tools",
                             "tool_choice")
        return cls(tools, "function", named[:1], False)

    @property
    def grammar(self) -> str | None:
        """The grammar that makes the output a call; None unless the choice forces one."""
        return tool_call_grammar(self.forced, self.parallel) if self.forced else None

    def parser(self) -> ToolCallParser | None:
        """A parser for one choice's text; None with "none", whose text is all content."""
        return ToolCallParser(self.parallel, content=not self.forced) if self.choice != "none" else None

    def chat_prompt(self, engine: AsyncLLMEngine, conversation: list[dict], chat_template_kwargs: dict | None,
                    **options) -> list[int]:
        """The prompt, the tools rendered by the chat template, or, by a template that ignores them,
        in the system message (``tools_in_system_message``); a 400 naming what the engine refused."""
        try:
            prompt = engine.chat_prompt(conversation, chat_template_kwargs, self.tools or None, **options)
            if self.tools and prompt == engine.chat_prompt(conversation, chat_template_kwargs, **options):
                prompt = engine.chat_prompt(tools_in_system_message(conversation, self.tools), chat_template_kwargs,
                                            **options)
        except ValueError as e:  # the prompt the engine makes of the messages, or the template's options
            field = next((f for f in ("chat_template_kwargs", "continue_final_message") if str(e).startswith(f)),
                         "messages")
            raise BadRequest(str(e), field) from None
        return prompt


def tools_in_system_message(conversation: list[dict], tools: list[dict]) -> list[dict]:
    """The conversation with the tools (their JSON, a line each) and how to call one added to its
    system message (a new one first, if it has none), and each earlier call an assistant message
    made written into its content, as the grammar writes a call."""
    listing = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    guide = (f"You may call the functions below to help you answer. Each is a JSON object, one a line:\n<tools>\n"
             f"{listing}\n</tools>\nTo call one, write its name and arguments as one JSON object between the tags "
             f'{START} and {END}, like this:\n{START}\n{{"name": "function_name", "arguments": {{"argument": '
             f'"value"}}}}\n{END}')

    def with_calls(message: dict) -> dict:
        calls = [json.dumps({"name": call["function"]["name"], "arguments": call["function"]["arguments"]},
                            ensure_ascii=False) for call in message.get("tool_calls", [])]
        tagged = [f"{START}\n{call}\n{END}" for call in calls]
        return {**message, "content": "\n".join(filter(None, [message.get("content"), *tagged]))} if calls else message
    conversation = [with_calls(m) for m in conversation]
    if conversation[0]["role"] == "system":
        return [{**conversation[0], "content": f"{conversation[0]['content']}\n\n{guide}"}, *conversation[1:]]
    return [{"role": "system", "content": guide}, *conversation]
