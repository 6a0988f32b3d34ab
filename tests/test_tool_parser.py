"""The tool parser: the calls and content it finds in a model's text, the same whether the text
comes whole or in any pieces, and its deltas in OpenAI's streaming order."""

import json
import random

import pytest

from nanoengine.openai_tool_parser import ToolCallParser

QWEN = ('I will look it up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa\\"ris}", "days": [1, '
        '{"a": "]"}]}}\n</tool_call>\n<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>\n')
# text, content, [(name, arguments)]
CASES = {
    "hermes, two calls": (QWEN, "I will look it up.", [
        ("get_weather", '{"city": "Pa\\"ris}", "days": [1, {"a": "]"}]}'), ("ping", "{}")]),
    "smollm2's list": ('<tool_call>[\n{"name": "a", "arguments": {"x": 1}},\n{"name": "b", "arguments": {}}\n]'
                       '</tool_call>', "", [("a", '{"x": 1}'), ("b", "{}")]),
    "arguments first, parameters": ('<tool_call>{"parameters": {"x": "é"}, "name": "a"}</tool_call> Done.', "Done.",
                                    [("a", '{"x": "é"}')]),
    "a block that is not a call": ("See <tool_call>no json</tool_call> here  ",
                                   "See<tool_call>no json</tool_call> here", []),
    "cut in the arguments": ('<tool_call>\n{"name": "a", "arguments": {"x": "ab', "", [("a", '{"x": "ab')]),
    "cut before the arguments": ('Hm <tool_call>\n{"nam', 'Hm<tool_call>\n{"nam', []),
    "a tag never finished": ("Less than <tool_ca", "Less than <tool_ca", []),
    "no call": ("  Just text,\n\n", "Just text,", []),
    "a name with an escape": ('<tool_call>{"name": "get_\\u0074ime", "arguments": {}}</tool_call>', "",
                              [("get_time", "{}")]),
    "a name with an escape JSON lacks": ('<tool_call>{"name": "a\\q", "arguments": {}}</tool_call>', "",
                                         [("a\\q", "{}")]),
    # Arguments some models write as a JSON string: its text, the object, in either key order (the
    # name first gave the quoted string, which a client's json.loads turned into a str).
    "arguments as a JSON string": ('<tool_call>\n{"name": "a", "arguments": "{\\"x\\": \\"Pa\\\\\\"ris\\"}"}\n'
                                   '</tool_call>', "", [("a", '{"x": "Pa\\"ris"}')]),
    "arguments as a JSON string, first": ('<tool_call>{"arguments": "{\\"x\\": 1}", "name": "a"}</tool_call>', "",
                                          [("a", '{"x": 1}')]),
}


def parse(text: str, cuts: list[int], parallel: bool = True) -> tuple[str, list[tuple[str, str]]]:
    """Feed ``text`` in pieces cut at ``cuts``; the content and calls, rebuilt from the deltas,
    which are checked to agree with the parser's own ``calls``."""
    parser, content, calls = ToolCallParser(parallel), "", {}
    pieces = [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])]
    for k, piece in enumerate(pieces):
        new_content, deltas = parser.feed(piece, final=k == len(pieces) - 1)
        content += new_content
        indices = [delta["index"] for delta in deltas]
        assert len(set(indices)) == len(indices)  # one entry a call in a chunk, as OpenAI streams them
        for delta in deltas:
            if delta["index"] not in calls:  # a call's first delta: its id and name, and the arguments so far
                assert set(delta) == {"index", "id", "type", "function"}
                assert delta["id"].startswith("call_") and delta["type"] == "function"
                calls[delta["index"]] = [delta["function"]["name"], delta["function"]["arguments"]]
            else:
                assert set(delta) == {"index", "function"} and set(delta["function"]) == {"arguments"}
                calls[delta["index"]][1] += delta["function"]["arguments"]
    whole = [(c["function"]["name"], c["function"]["arguments"]) for c in parser.calls]
    assert [tuple(c) for c in calls.values()] == whole
    return content, whole


@pytest.mark.parametrize("name", CASES)
def test_calls_and_content_are_the_same_whole_and_in_any_pieces(name):
    text, content, calls = CASES[name]
    assert parse(text, []) == (content, calls)
    assert parse(text, list(range(1, len(text)))) == (content, calls)  # character by character
    rng = random.Random(name)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8))))
        assert parse(text, cuts) == (content, calls), cuts


def test_the_arguments_stream_as_they_come_and_are_json():
    parser = ToolCallParser()
    _, first = parser.feed('<tool_call>\n{"name": "get_weather", "arguments": {"ci')
    assert [d["function"] for d in first] == [{"name": "get_weather", "arguments": '{"ci'}]  # one entry a call
    _, second = parser.feed('ty": "Oslo"}}\n</tool_call>', final=True)
    assert second == [{"index": 0, "function": {"arguments": 'ty": "Oslo"}'}}]
    assert json.loads(parser.calls[0]["function"]["arguments"]) == {"city": "Oslo"}


def test_without_parallel_calls_only_the_first_is_kept():
    assert parse(QWEN, [], parallel=False) == ("I will look it up.", [CASES["hermes, two calls"][2][0]])
    assert parse(QWEN, list(range(1, len(QWEN))), parallel=False)[1] == [CASES["hermes, two calls"][2][0]]


@pytest.mark.parametrize("cut", ["<", "<tool_", "<tool_call>\n{\"na"])
def test_forced_calls_have_no_content_even_where_max_tokens_cuts_the_next_tag(cut):
    """A grammar that forces calls lets the model begin another after the first; cut there, the
    partial tag is not content (the message's content stays null)."""
    text = '<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n' + cut
    for pieces in ([text], list(text)):
        parser, content = ToolCallParser(content=False), ""
        for k, piece in enumerate(pieces):
            content += parser.feed(piece, final=k == len(pieces) - 1)[0]
        assert content == "" and [c["function"]["name"] for c in parser.calls] == ["a"]
    assert ToolCallParser().feed(text, final=True)[0] == cut  # with content, as written


def test_every_call_has_its_own_id():
    parser = ToolCallParser()
    parser.feed(QWEN, final=True)
    assert len({call["id"] for call in parser.calls}) == 2


@pytest.mark.parametrize("text, whole", [
    ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>', True),
    ('<tool_call>\n{"name": "f", "arguments": {"a": 1', False),  # cut short
    ('<tool_call>\n{"name": "f", "arguments": {"a": }}\n</tool_call>', False),  # nested right, not JSON
])
def test_a_call_is_whole_only_if_its_arguments_are_json(text, whole):
    parser = ToolCallParser()
    parser.feed(text, final=True)
    assert len(parser.calls) == 1 and parser.whole is whole
