"""The tool parser: finds the tool calls in what a model wrote, whole or as it streams.

The chat templates that render tools teach a model to write its calls in one of two forms, both
parsed here:

- Hermes's, which Qwen2.5, Qwen3, Hermes 2 and 3 (and SmolLM3) write: each call a JSON object in
  tags, ``<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>``;
- SmolLM2's tool-tuned models': a JSON list of such objects in one pair of tags.

``"parameters"`` is read where ``"arguments"`` is missing (Llama 3's name for them). Other formats
(Llama 3's bare JSON, Mistral's ``[TOOL_CALLS]``, pythonic lists) are not parsed: their text stays
content. The grammar that forces a call (openai_tool_calls.py) writes Hermes's form, so one parser serves
``"auto"``, ``"required"`` and a named function. serve.py feeds each choice's text through a
``ToolCallParser`` into OpenAI's ``tool_calls``.
"""

import json
import re
import uuid

START, END = "<tool_call>", "</tool_call>"
# A call that names its function first, as the templates write it, with its arguments an object (or
# a list): they can stream as they come, as written. A call written any other way is parsed once its
# closing tag arrives; so are arguments written as a JSON string (``"{\"a\": 1}"``), which only then
# can be unquoted, so that they are the same object in either key order.
HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,'
                  r'\s*"(?:arguments|parameters)"\s*:\s*(?=[{\[])')


def new_call(name: str, arguments: str) -> dict:
    """A call as a response's ``message.tool_calls`` holds it: ``arguments`` a JSON string."""
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _calls_in(block: str) -> list[tuple[str, str]] | None:
    """(name, arguments) of each call in a tagged block written as one object or a list; None if
    it is neither."""
    try:
        value = json.loads(block)
    except ValueError:
        return None
    calls = value if isinstance(value, list) else [value]
    found = []
    for call in calls:
        arguments = call.get("arguments", call.get("parameters")) if isinstance(call, dict) else None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or arguments is None:
            return None
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        found.append((call["name"], arguments))
    return found


class ToolCallParser:
    """Splits one choice's text, fed in pieces as it is generated, into content and tool calls.

    ``feed`` returns what a piece adds: content text, and OpenAI's streamed tool-call deltas, one
    a call (its first with its ``index``, ``id``, ``type``, ``function.name`` and the arguments
    that came with it, then fragments of its arguments, given out as they arrive). ``calls`` holds every call so far, whole.
    Fed all at once (a response) or token by token (a stream), a text gives the same calls and
    content, since nothing is decided before the text that decides it has arrived: text that could
    still begin a tag is held back, and so are blanks until content follows them (the blanks around
    calls never reach the content). A tagged block that is not a call is content, as written; with
    ``parallel`` false, calls after the first are dropped. At ``final``, what is held back is given
    out as content; a call cut short (``max_tokens``) keeps the arguments it has. Without
    ``content`` (a grammar forced the calls, so there is none) nothing is content: the text around
    the calls is the grammar's, and a tag cut short by ``max_tokens`` is dropped, not given out.
    """

    def __init__(self, parallel: bool = True, content: bool = True):
        self.parallel, self.has_content = parallel, content
        self.calls: list[dict] = []
        self.pending = ""  # text not yet given out
        self.state = "text"  # "text" | "head" (in a tag, before the arguments) | "arguments" | "tail" (to the end tag)
        self.after_call = True  # at the start, or just after a call: blanks here are not content
        self.dropping = False  # the current call is one past the first, and parallel is false
        self.depth, self.in_string, self.escaped = 0, False, False  # where the arguments' JSON is

    @property
    def whole(self) -> bool:
        """Whether every call's arguments are JSON: none cut short (by ``max_tokens``, or a stop
        string in ``"auto"``) or written wrong by the model."""
        try:
            for call in self.calls:
                json.loads(call["function"]["arguments"])
        except ValueError:
            return False
        return True

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict]]:
        self.pending += text
        content, deltas = [], []
        steps = {"text": self._text, "head": self._head, "arguments": self._arguments, "tail": self._tail}
        while steps[self.state](content, deltas):
            pass
        if final:
            if self.state in ("text", "head"):  # held back, or a tag never closed: what was written is content
                self._content(START + self.pending if self.state == "head" else self.pending, content)
            self.pending = ""
        return "".join(content), deltas

    def _text(self, content: list[str], deltas: list[dict]) -> bool:
        start = self.pending.find(START)
        if start >= 0:
            self._content(self.pending[:start], content)
            self.pending, self.state = self.pending[start + len(START):], "head"
            return True
        # Hold back what may begin the tag, and the blanks before it.
        keep = next((k for k in range(min(len(START) - 1, len(self.pending)), 0, -1)
                     if START.startswith(self.pending[-k:])), 0)
        text = self.pending[:len(self.pending) - keep]
        self.pending = self.pending[len(text.rstrip()):]
        self._content(text, content)
        return False

    def _content(self, text: str, content: list[str]) -> None:
        text = text.rstrip()
        if text and self.has_content:
            content.append(text.lstrip() if self.after_call else text)
            self.after_call = False

    def _head(self, content: list[str], deltas: list[dict]) -> bool:
        if match := HEAD.match(self.pending):
            self.pending, self.state = self.pending[match.end():], "arguments"
            try:
                name = json.loads(f'"{match.group(1)}"')
            except ValueError:  # an escape JSON does not have: the name as written
                name = match.group(1)
            self._open(name, deltas)
            return True
        end = self.pending.find(END)
        if end < 0:
            return False
        block, self.pending, self.state = self.pending[:end], self.pending[end + len(END):], "text"
        if (calls := _calls_in(block)) is None:
            self._content(START + block + END, content)
            return True
        for name, arguments in calls:
            self._open(name, deltas)
            self._arguments_delta(arguments, deltas)
        self.after_call = True
        return True

    def _arguments(self, content: list[str], deltas: list[dict]) -> bool:
        """Give out the arguments' JSON up to where its value closes, tracking its nesting."""
        for i, char in enumerate(self.pending):
            if self.in_string:
                self.escaped, self.in_string = (False, True) if self.escaped else (char == "\\", char != '"')
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
            if self.depth == 0 and not self.in_string:  # the value is whole
                self._arguments_delta(self.pending[:i + 1], deltas)
                self.pending, self.state = self.pending[i + 1:], "tail"
                return True
        self._arguments_delta(self.pending, deltas)
        self.pending = ""
        return False

    def _tail(self, content: list[str], deltas: list[dict]) -> bool:
        """Skip what follows the arguments (the object's closing brace) up to the end tag."""
        end = self.pending.find(END)
        if end < 0:
            return False
        self.pending, self.state, self.after_call = self.pending[end + len(END):], "text", True
        return True

    def _open(self, name: str, deltas: list[dict]) -> None:
        self.dropping = bool(self.calls) and not self.parallel
        if not self.dropping:
            self.calls.append(new_call(name, ""))
            call = self.calls[-1]
            deltas.append({"index": len(self.calls) - 1, "id": call["id"], "type": "function",
                           "function": {"name": name, "arguments": ""}})

    def _arguments_delta(self, text: str, deltas: list[dict]) -> None:
        if text and not self.dropping:
            self.calls[-1]["function"]["arguments"] += text
            index = len(self.calls) - 1
            if deltas and deltas[-1]["index"] == index:  # one entry a call in a chunk, as OpenAI streams them
                deltas[-1]["function"]["arguments"] += text
            else:
                deltas.append({"index": index, "function": {"arguments": text}})
