"""Tools in the chat API: what a request's ``tools`` and ``tool_choice`` ask of the model, and the
grammar that makes it call one.

- ``"none"`` (the default without tools): the tools are not rendered and nothing is parsed, so the
  model cannot call one.
- ``"auto"`` (the default with tools): the chat template renders the tools into the prompt, the
  model writes freely, and the tool parser (tool_parser.py) finds the calls it made. Only a template
  that renders tools teaches the model to call them, so a template that ignores them is refused.
- ``"required"`` and a named function: ``tool_call_grammar`` makes the output one or more calls
  (one with a named function, or with ``parallel_tool_calls: false``), in the format the parser
  reads, each call's name one of the tools' and its arguments valid for that function's
  ``parameters`` schema. This holds whatever the template does with the tools.

serve.py renders the prompt through ``ToolChoice.chat_prompt`` and hands ``grammar`` to
openai_structured.py, which compiles it as any other constraint.
"""

import json
from dataclasses import dataclass

from nanoengine.async_engine import AsyncLLMEngine
from nanoengine.openai_chat_protocol import ChatCompletionRequest
from nanoengine.openai_protocol import BadRequest
from nanoengine.structured_output import closed_objects
from nanoengine.tool_parser import END, START, ToolCallParser


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
        schema = function.get("parameters") or {"type": "object", "properties": {}, "additionalProperties": False}
        schema = {**json.loads(closed_objects(json.dumps(schema))), "x-guidance": {"whitespace_flexible": False}}
        return f"{head} %json {json.dumps(schema)} {tail}"
    repeat = ' ("\\n" call)*' if parallel else ""
    return f"start: call{repeat}\ncall: " + " | ".join(call(tool["function"]) for tool in tools)


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
        """The prompt, the tools rendered by the chat template; with "auto", a 400 if the template
        ignores them (it renders the same prompt without them): the model could never call one."""
        prompt = engine.chat_prompt(conversation, chat_template_kwargs, self.tools or None, **options)
        if self.choice == "auto" and prompt == engine.chat_prompt(conversation, chat_template_kwargs, **options):
            raise BadRequest('tool_choice "auto": this model\'s chat template does not render tools, so the model '
                             'cannot know them; use "required" or a named function, whose calls a grammar writes',
                             "tool_choice")
        return prompt
