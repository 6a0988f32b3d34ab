"""Structured output and tool calls through the server, driven by the official openai client:
``response_format`` (and the client's ``parse`` with a pydantic model), vLLM's
``structured_outputs`` and ``guided_*`` extras, and ``tools`` with every ``tool_choice``, whole and
streamed. The tiny model's weights are random and it samples at temperature 1.0: every finished
("stop") output that parses and validates is the grammar's doing.
"""

import json
import threading
from typing import Annotated

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("llguidance")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")

from pydantic import BaseModel, Field  # noqa: E402

from nanoengine import LLM  # noqa: E402
from nanoengine.openai_chat_protocol import ChatCompletionRequest  # noqa: E402
from nanoengine.openai_protocol import BadRequest  # noqa: E402
from nanoengine.sampling_params import StructuredOutputsParams  # noqa: E402
from nanoengine.openai_tool_calls import ToolChoice  # noqa: E402
from tests.conftest import with_chat_template  # noqa: E402
from tests.test_serve import in_process_server  # noqa: E402
from tests.test_structured_output import ARITHMETIC, CHOICES, PERSON, PHONE, check  # noqa: E402

# A Hermes-style template, as Qwen2.5's: the tools in the system turn, an assistant's calls in
# <tool_call> tags, a tool's answer in <tool_response> tags.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nYou may call these functions:\n<tools>{% for tool in tools %}\n"
    "{{ tool | tojson }}{% endfor %}\n</tools>\nFor each call, write <tool_call>{\"name\": ..., \"arguments\": ...}"
    "</tool_call>.<|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for call in m.tool_calls or [] %}<tool_call>\n{{ {'name': call.function.name, "
    "'arguments': call.function.arguments} | tojson }}\n</tool_call>{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "required": ["city", "unit"], "additionalProperties": False, "properties": {
        "city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "required": ["zone"], "additionalProperties": False,
    "properties": {"zone": {"enum": ["UTC", "CET"]}}}}}
NO_ARGUMENTS = {"type": "function", "function": {"name": "ping"}}
TOOLS = [WEATHER, CLOCK, NO_ARGUMENTS]
SCHEMAS = {tool["function"]["name"]: tool["function"].get("parameters", {"type": "object", "maxProperties": 0})
           for tool in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
SAMPLED = dict(temperature=1.0, max_tokens=96)


class City(BaseModel):
    name: str = Field(max_length=10)
    population: int = Field(ge=0, le=10 ** 6)
    sights: list[Annotated[str, Field(max_length=8)]] = Field(max_length=2)


@pytest.fixture(scope="module")
def tools_model(tiny_models, tmp_path_factory) -> str:
    return with_chat_template(tiny_models["llama"], str(tmp_path_factory.mktemp("tools") / "llama"), TOOLS_TEMPLATE)


@pytest.fixture(scope="module")
def llm(tools_model):
    return LLM(tools_model, dtype="float32", max_model_len=512)


@pytest.fixture(scope="module")
def served(tools_model):
    with in_process_server(tools_model, max_model_len=512) as (url, engine):
        yield url, engine


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served[0]}/v1", api_key="x", max_retries=0, timeout=60)


def finished(choices) -> list:
    assert all(c.finish_reason in ("stop", "length", "tool_calls") for c in choices)
    return [c for c in choices if c.finish_reason in ("stop", "tool_calls")]


def validated_calls(message) -> list[tuple[str, dict]]:
    """Each call's name and arguments, the arguments checked against that function's schema."""
    calls = []
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        calls.append((call.function.name, arguments))
    return calls


def test_a_grammar_that_fails_mid_answer_is_served_its_text_once_and_whole(client):
    """A self-referencing property: after '{"a":' the library gives up ("abort"). Whole and streamed,
    the text is what came before, sent once; with a stop string the characters held back in case
    they began one are sent too."""
    itself = {"type": "object", "properties": {"a": {"$ref": "#/properties/a"}}, "required": ["a"]}
    request = dict(model="tiny", prompt="Write:", max_tokens=16, extra_body={"structured_outputs": {"json": itself}})
    for stop in (None, ["zzzzzz"]):
        whole = client.completions.create(stop=stop, **request).choices[0]
        chunks = [c.choices[0] for c in client.completions.create(stream=True, stop=stop, **request) if c.choices]
        assert (whole.text, whole.finish_reason) == ('{"a":', "abort")
        assert "".join(c.text for c in chunks) == '{"a":' and chunks[-1].finish_reason == "abort"


@pytest.mark.parametrize("path", ["chat/completions", "completions"])
def test_response_format_json_schema_outputs_validate_with_n_samples(client, path):
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    if path == "completions":
        response = client.completions.create(model="tiny", prompt="A person:", n=8, seed=1, **SAMPLED,
                                             extra_body={"response_format": response_format})
        texts = [c.text for c in finished(response.choices)]
    else:
        response = client.chat.completions.create(model="tiny", messages=ASK, n=8, seed=1,
                                                  response_format=response_format, **SAMPLED)
        texts = [c.message.content for c in finished(response.choices)]
    assert len(response.choices) == 8 and len(texts) >= 2
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON)


def test_response_format_json_object_gives_a_json_object(client):
    response = client.chat.completions.create(model="tiny", messages=ASK, n=8, seed=2, temperature=1.0, max_tokens=160,
                                              response_format={"type": "json_object"})
    done = finished(response.choices)
    assert done, "some of the samples close their object within max_tokens"
    assert all(isinstance(json.loads(c.message.content), dict) for c in done)


def test_the_clients_parse_returns_the_pydantic_object(client):
    completion = client.chat.completions.parse(model="tiny", messages=ASK, response_format=City, seed=3,
                                               temperature=1.0, max_tokens=160)
    message = completion.choices[0].message
    assert isinstance(message.parsed, City) and message.parsed == City.model_validate_json(message.content)


@pytest.mark.parametrize("extra, params", [
    ({"structured_outputs": {"json": PERSON}}, StructuredOutputsParams(json=PERSON)),
    ({"structured_outputs": {"regex": PHONE}}, StructuredOutputsParams(regex=PHONE)),
    ({"structured_outputs": {"choice": CHOICES}}, StructuredOutputsParams(choice=CHOICES)),
    ({"structured_outputs": {"grammar": ARITHMETIC}}, StructuredOutputsParams(grammar=ARITHMETIC)),
    ({"guided_json": json.dumps(PERSON)}, StructuredOutputsParams(json=PERSON)),
    ({"guided_regex": PHONE}, StructuredOutputsParams(regex=PHONE)),
    ({"guided_choice": CHOICES}, StructuredOutputsParams(choice=CHOICES)),
    ({"guided_grammar": ARITHMETIC}, StructuredOutputsParams(grammar=ARITHMETIC)),
], ids=lambda x: next(iter(x)) if isinstance(x, dict) and "structured_outputs" not in x else None)
def test_vllms_extras_constrain_the_output(client, extra, params):
    response = client.completions.create(model="tiny", prompt="Answer:", n=6, seed=4, extra_body=extra, **SAMPLED)
    done = finished(response.choices)
    assert done
    for c in done:
        check(params, c.text)


@pytest.mark.parametrize("body, names", [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "response_format and guided_regex"),
    ({"structured_outputs": {"regex": "a"}, "guided_choice": ["a"]}, "structured_outputs and guided_choice"),
    ({"structured_outputs": {"regex": "a"}, "tools": TOOLS, "tool_choice": "required"},
     "structured_outputs and tool_choice"),
])
def test_two_constraints_in_one_request_are_a_400_naming_them(served, body, names):
    response = httpx.post(f"{served[0]}/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **body},
                          timeout=30)
    assert response.status_code == 400 and names in response.json()["error"]["message"], response.text


DEEP = {"type": "string"}
for _ in range(300):  # a schema nested past what the template's renderer recurses through
    DEEP = {"type": "object", "properties": {"a": DEEP}}


@pytest.mark.parametrize("body, param, message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object",
                                                                                         "properties": 5}}}},
     "response_format", "response_format.json_schema.schema is not a grammar llguidance accepts: properties"),
    ({"guided_regex": "(unclosed"}, "guided_regex", "guided_regex is not a grammar llguidance accepts"),
    ({"structured_outputs": {"grammar": "root ::= nothing_defined"}}, "structured_outputs",
     "structured_outputs.grammar is not a grammar llguidance accepts"),
    ({"guided_choice": []}, "guided_choice", "choice must be a non-empty list"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
     "structured_outputs takes exactly one of json, json_object, regex, choice, grammar; got ['regex', 'choice']"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "nonsense"}}}}}], "tool_choice": "required"}, "tools",
     "the parameters of 'f' are not a JSON schema llguidance accepts: Invalid type"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]}, "tools",
     "parameters must be the JSON schema of an object, got type 'string'"),  # f(**arguments) takes an object
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": DEEP}}], "tool_choice": "required"},
     "messages", "the chat template rejected the messages: maximum recursion depth"),  # was a 500
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema is given with type"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nowhere"}}}, "tool_choice",
     "'nowhere', which is not one of the tools"),
    # arguments no JSON value matches: the call's head could be written, its arguments never ended
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "f", "parameters": {"$ref": "#"}}}],
      "tool_choice": "required"}, "tools", "the parameters of 'f' are not a JSON schema llguidance accepts: no text"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": {
        "type": "array", "uniqueItems": True}}}}, "response_format", "uniqueItems"),  # strict: refused, not ignored
])
def test_a_grammar_or_tool_request_that_cannot_be_served_is_a_400_and_the_server_serves_on(served, body, param,
                                                                                            message):
    url, _ = served
    response = httpx.post(f"{url}/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **body}, timeout=30)
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == param and message in error["message"], response.text
    good = httpx.post(f"{url}/v1/chat/completions", timeout=30, json={
        "messages": ASK, "max_tokens": 16, "response_format": {"type": "json_schema", "json_schema": {
            "name": "choice", "schema": {"enum": CHOICES}}}})
    assert good.status_code == 200 and json.loads(good.json()["choices"][0]["message"]["content"]) in CHOICES


def test_a_named_function_is_called_with_arguments_that_validate(client):
    response = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, n=6, seed=5, **SAMPLED,
                                              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    done = finished(response.choices)
    assert done
    for c in done:
        assert c.finish_reason == "tool_calls" and c.message.content is None
        [(name, arguments)] = validated_calls(c.message)
        assert name == "get_weather"


def test_a_forced_call_wins_over_response_format_which_is_for_text_replies(client):
    """OpenAI's Agents SDK sends its output schema with every turn, a forced tool call included."""
    response = client.chat.completions.create(
        model="tiny", messages=ASK, tools=TOOLS, seed=5, **SAMPLED, response_format={"type": "json_object"},
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert response.choices[0].finish_reason == "tool_calls"
    assert [name for name, _ in validated_calls(response.choices[0].message)] == ["get_time"]


@pytest.mark.parametrize("parameters", [{"type": "object", "properties": {}}, {"type": "object"}])
def test_a_function_that_declares_no_arguments_is_called_with_none(client, llm, parameters):
    """LangChain's schema for a tool without arguments: an object with no properties, or none at all.
    Every token that opens a property name is pushed up: only the grammar keeps it out."""
    tool = {"type": "function", "function": {"name": "now", "parameters": parameters}}
    quotes = {str(t): 100 for t in range(len(llm.tokenizer)) if llm.tokenizer.decode([t]).startswith(('"', '{"'))}
    response = client.chat.completions.create(model="tiny", messages=ASK, tools=[tool], n=4, seed=3, **SAMPLED,
                                              logit_bias=quotes,
                                              tool_choice={"type": "function", "function": {"name": "now"}})
    done = finished(response.choices)
    assert done and all(c.message.tool_calls[0].function.arguments == "{}" for c in done)


@pytest.mark.parametrize("strict", [None, False, True])
def test_a_function_that_is_not_strict_ignores_keywords_llguidance_lacks(served, strict):
    """instructor's, LangChain's and pydantic-ai's tool modes send a pydantic ``set`` as ``uniqueItems``."""
    function = {"name": "tag", "parameters": {"type": "object", "required": ["tags"], "properties": {
        "tags": {"type": "array", "uniqueItems": True, "maxItems": 2, "items": {"enum": CHOICES}}}}}
    response = httpx.post(f"{served[0]}/v1/chat/completions", timeout=60, json={
        "messages": ASK, "max_tokens": 48, "tool_choice": "required",
        "tools": [{"type": "function", "function": {**function, **({"strict": strict} if strict is not None else {})}}]})
    if strict:
        assert response.status_code == 400 and "uniqueItems" in response.json()["error"]["message"]
    else:
        assert response.status_code == 200, response.text


def test_a_schema_that_is_not_strict_ignores_keywords_llguidance_lacks(client):
    """pydantic-ai's set[str] is ``uniqueItems``: with strict false, enforced as far as llguidance can."""
    schema = {"type": "array", "uniqueItems": True, "maxItems": 3, "items": {"enum": CHOICES}}
    response = client.chat.completions.create(model="tiny", messages=ASK, seed=4, **SAMPLED, response_format={
        "type": "json_schema", "json_schema": {"name": "tags", "strict": False, "schema": schema}})
    for c in finished(response.choices):
        assert set(json.loads(c.message.content)) <= set(CHOICES)


def test_stop_strings_do_not_cut_a_forced_call(client):
    """LangChain sends stop strings with every request: inside a forced call they would only cut its
    arguments, so the grammar alone ends it, as OpenAI never cuts a call."""
    request = dict(model="tiny", messages=ASK, tools=TOOLS, seed=5, **SAMPLED,
                   tool_choice={"type": "function", "function": {"name": "get_weather"}})
    plain = client.chat.completions.create(**request).choices[0]
    arguments = plain.message.tool_calls[0].function.arguments
    stopped = client.chat.completions.create(**request, stop=[arguments[2:5], "\n"]).choices[0]
    assert stopped.finish_reason == plain.finish_reason == "tool_calls"
    assert stopped.message.tool_calls[0].function.arguments == arguments


def test_required_makes_one_or_more_calls_of_the_tools_and_parallel_false_one(client):
    for parallel in (True, False):
        response = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required",
                                                  parallel_tool_calls=parallel, n=6, seed=6, **SAMPLED)
        done = finished(response.choices)
        assert done
        for c in done:
            calls = validated_calls(c.message)
            assert c.finish_reason == "tool_calls" and len(calls) >= 1 and (parallel or len(calls) == 1)


def streamed_calls(chunks) -> tuple[list[tuple[str, str]], str | None, int]:
    """The calls a stream's deltas add up to, its finish reason and how many argument fragments
    came, checking OpenAI's order: a call's first delta has its id, type, name and the arguments so
    far; later ones only fragments of its arguments; a chunk has one entry a call."""
    calls, finish_reason, fragments = {}, None, 0
    for chunk in chunks:
        choice = chunk.choices[0]
        assert choice.delta.content or choice.delta.tool_calls or choice.delta.role or choice.finish_reason, \
            "a chunk of nothing"  # the text the parser holds back (tags) sends no chunk
        finish_reason = choice.finish_reason or finish_reason
        indices = [delta.index for delta in choice.delta.tool_calls or []]
        assert len(set(indices)) == len(indices)  # a client that reads tool_calls[0] gets the whole delta
        for delta in choice.delta.tool_calls or []:
            if delta.index not in calls:
                assert delta.id.startswith("call_") and delta.type == "function"
                calls[delta.index] = [delta.function.name, delta.function.arguments or ""]
            else:
                assert delta.id is None and delta.function.name is None
                calls[delta.index][1] += delta.function.arguments
                fragments += 1
    return [tuple(call) for call in calls.values()], finish_reason, fragments


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_streamed_tool_call_deltas_add_up_to_the_whole_response(client, tool_choice):
    request = dict(model="tiny", messages=ASK, tools=[WEATHER, CLOCK], tool_choice=tool_choice, seed=7, **SAMPLED)
    whole = client.chat.completions.create(**request).choices[0]
    assert whole.finish_reason == "tool_calls"
    calls, finish_reason, fragments = streamed_calls(client.chat.completions.create(stream=True, **request))
    assert calls == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert finish_reason == "tool_calls" and fragments > len(calls)  # the arguments came token by token


# A model that calls a tool of its own accord: a regex writes what a Hermes-style model would.
HERMES_OUTPUT = ('Let me check\\.\\n<tool_call>\\n\\{"name": "get_weather", "arguments": '
                 '\\{"city": "(Paris|Rome)", "unit": "celsius"\\}\\}\\n</tool_call>')


def test_auto_renders_the_tools_and_parses_a_hermes_call_whole_and_streamed(client, llm):
    request = dict(model="tiny", messages=ASK, tools=TOOLS, seed=8, **SAMPLED,
                   extra_body={"guided_regex": HERMES_OUTPUT})
    response = client.chat.completions.create(**request)  # tool_choice "auto": the default with tools
    assert response.usage.prompt_tokens == len(llm.chat_prompt(ASK, tools=TOOLS)) > len(llm.chat_prompt(ASK))
    message = response.choices[0].message
    assert response.choices[0].finish_reason == "tool_calls" and message.content == "Let me check."
    [(name, arguments)] = validated_calls(message)
    assert name == "get_weather" and arguments["city"] in ("Paris", "Rome")
    chunks = list(client.chat.completions.create(stream=True, **request))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Let me check."
    assert streamed_calls(chunks)[:2] == ([(name, message.tool_calls[0].function.arguments)], "tool_calls")


@pytest.mark.parametrize("call", ['{"name": "get_time", "arguments": "{\\"zone\\": \\"UTC\\"}"}',
                                  '{"arguments": "{\\"zone\\": \\"UTC\\"}", "name": "get_time"}'])
def test_arguments_a_model_writes_as_a_json_string_reach_the_client_as_an_object(client, call):
    """Whichever key the model writes first, whole and streamed: with the name first, the client's
    json.loads of the arguments gave the string ``{"zone": "UTC"}``, not the object."""
    request = dict(model="tiny", messages=ASK, tools=TOOLS, temperature=1.0, max_tokens=160, seed=9,
                   extra_body={"guided_choice": [f"<tool_call>\n{call}\n</tool_call>"]})
    whole = client.chat.completions.create(**request).choices[0]
    assert whole.finish_reason == "tool_calls" and validated_calls(whole.message) == [("get_time", {"zone": "UTC"})]
    calls, finish_reason, _ = streamed_calls(client.chat.completions.create(stream=True, **request))
    assert [(name, json.loads(arguments)) for name, arguments in calls] == [("get_time", {"zone": "UTC"})]
    assert finish_reason == "tool_calls"


def test_a_call_a_stop_string_cut_in_auto_says_stop_and_a_forced_one_cut_has_no_content(client):
    request = dict(model="tiny", messages=ASK, tools=TOOLS, seed=8, **SAMPLED, extra_body={"guided_regex": HERMES_OUTPUT})
    cut = client.chat.completions.create(**request, stop=["celsius"]).choices[0]
    assert cut.message.tool_calls and not cut.message.tool_calls[0].function.arguments.endswith("}")
    assert cut.finish_reason == "stop"  # not "tool_calls": its arguments are not whole
    forced = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=3,
                                            tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert forced.choices[0].finish_reason == "length" and forced.choices[0].message.content is None
    assert not forced.choices[0].message.tool_calls


def test_tokenize_counts_a_conversation_with_tools_as_the_chat_endpoint_renders_it(served, llm, tiny_models):
    url, _ = served
    tokens = httpx.post(f"{url}/tokenize", json={"messages": ASK, "tools": TOOLS}, timeout=30).json()["tokens"]
    assert tokens == llm.chat_prompt(ASK, tools=TOOLS) != llm.chat_prompt(ASK)
    chat = httpx.post(f"{url}/v1/chat/completions", json={"messages": ASK, "tools": TOOLS, "max_tokens": 1}, timeout=30)
    assert chat.json()["usage"]["prompt_tokens"] == len(tokens)
    refused = httpx.post(f"{url}/tokenize", json={"messages": ASK, "chat_template_kwargs": {"messages": []}}, timeout=30)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template_kwargs"


def test_a_template_that_ignores_tools_gets_them_in_the_system_message_and_none_renders_none(tiny_models):
    plain = LLM(tiny_models["llama"], dtype="float32")  # a ChatML template without tools
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": {"zone": "UTC"}}}
    conversation = [{"role": "system", "content": "Be brief."}, *ASK,
                    {"role": "assistant", "content": "", "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": "call_1", "content": "noon"}]
    for choice in ("auto", "required"):
        tools = ToolChoice.of(ChatCompletionRequest.model_validate({"messages": ASK, "tools": TOOLS,
                                                                     "tool_choice": choice}))
        text = plain.tokenizer.decode(tools.chat_prompt(plain, conversation, None))
        system, user, assistant, tool = text.split("<|im_start|>")[1:5]
        assert system.startswith("system\nBe brief.\n\nYou may call the functions below")
        assert all(json.dumps(tool) in system for tool in TOOLS) and "<tool_call>" in system
        assert user.startswith("user\nWhat is the weather")
        assert '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>' in assistant
        assert tool.startswith("tool\nnoon")
        alone = plain.tokenizer.decode(tools.chat_prompt(plain, ASK, None))  # no system message: one added
        assert alone.split("<|im_start|>")[1].startswith("system\nYou may call the functions below")
    none = ToolChoice.of(ChatCompletionRequest.model_validate({"messages": ASK, "tools": TOOLS, "tool_choice": "none"}))
    assert none.tools == [] and none.grammar is None and none.parser() is None
    assert none.chat_prompt(plain, ASK, None) == plain.chat_prompt(ASK)


def test_the_servers_chat_template_flag_replaces_the_models(tiny_models, llm, tmp_path):
    """``--chat-template``: a template that renders tools, run on a model whose own ignores them."""
    from nanoengine.serve import use_chat_template
    path = tmp_path / "tools.jinja"
    path.write_text(TOOLS_TEMPLATE)
    with in_process_server(tiny_models["llama"], max_model_len=512) as (url, engine):
        use_chat_template(engine, str(path))
        response = httpx.post(f"{url}/v1/chat/completions", timeout=30,
                              json={"messages": ASK, "tools": TOOLS, "max_tokens": 1})
        assert response.json()["usage"]["prompt_tokens"] == len(llm.chat_prompt(ASK, tools=TOOLS))
        tokens = httpx.post(f"{url}/tokenize", json={"messages": ASK}, timeout=30).json()["tokens"]
        assert tokens == llm.chat_prompt(ASK)
        with pytest.raises(ValueError, match="the chat template rejected the messages"):
            use_chat_template(engine, "{% for m in messages %}{{ m.content }")  # its syntax: refused at start


def test_a_conversation_with_tool_calls_and_tool_results_reaches_the_template(client, llm):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                            "arguments": '{"city": "Paris", "unit": "celsius"}'}}
    messages = ASK + [{"role": "assistant", "content": None, "tool_calls": [call]},
                      {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"}]
    response = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=2,
                                              temperature=0)
    as_template_reads_it = ASK + [{"role": "assistant", "content": "", "tool_calls": [
        {**call, "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"}]
    expected = llm.chat_prompt(as_template_reads_it, tools=TOOLS)
    assert response.usage.prompt_tokens == len(expected)
    text = llm.tokenizer.decode(expected)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"' in text and "18 degrees" in text


def test_a_tool_call_the_sdk_returned_can_be_sent_back_with_its_result(client):
    messages = list(ASK)
    first = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, seed=9, **SAMPLED,
                                           tool_choice={"type": "function", "function": {"name": "ping"}})
    message = first.choices[0].message
    messages += [message, {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "pong"}]
    second = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=2)
    assert second.usage.prompt_tokens > first.usage.prompt_tokens


@pytest.mark.parametrize("message, complaint", [
    ({"role": "tool", "content": "18"}, "tool_call_id is required in a tool message"),
    ({"role": "user", "content": None}, "content is required"),
])
def test_a_malformed_tool_message_is_a_400_naming_it(served, message, complaint):
    response = httpx.post(f"{served[0]}/v1/chat/completions", json={"messages": ASK + [message]}, timeout=30)
    assert response.status_code == 400 and complaint in response.json()["error"]["message"], response.text
    assert response.json()["error"]["param"] == "messages"


@pytest.mark.parametrize("arguments, as_read", [('{"city": "Par', '{"city": "Par'), ("", {})])
def test_a_call_cut_short_can_be_sent_back(served, llm, arguments, as_read):
    """A call cut by max_tokens, as the client got it: arguments that are not JSON reach the template
    as text, none as {} (vLLM's reading); OpenAI takes any arguments."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    messages = ASK + [{"role": "assistant", "content": None, "tool_calls": [call]},
                      {"role": "tool", "tool_call_id": "call_1", "content": "error"}]
    response = httpx.post(f"{served[0]}/v1/chat/completions", timeout=30,
                          json={"messages": messages, "tools": TOOLS, "tool_choice": "none", "max_tokens": 1})
    assert response.status_code == 200, response.text
    expected = llm.chat_prompt([*ASK, {"role": "assistant", "content": "", "tool_calls": [
        {**call, "function": {"name": "get_weather", "arguments": as_read}}]}, messages[-1]])
    assert response.json()["usage"]["prompt_tokens"] == len(expected)


def test_grammars_are_compiled_off_the_engine_thread_once(served, monkeypatch):
    url, engine = served
    compiled_on, compile = [], engine.grammars._compile

    def recording_compile(kind: str, text: str):
        compiled_on.append(threading.current_thread().name)
        return compile(kind, text)
    monkeypatch.setattr(engine.grammars, "_compile", recording_compile)
    body = {"messages": ASK, "max_tokens": 8, "guided_regex": "[a-z]{1,20} off the engine thread"}
    assert httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30).status_code == 200
    assert len(compiled_on) == 1 and compiled_on[0] != "nanoengine"  # the engine thread found it cached
