"""``POST /v1/responses`` (OpenAI's Responses API) through the official openai client against the real
server: each response and each streamed event validated by the SDK's own types, a Responses
request read as the chat request it converts to (the same prompt: its input tokens are the chat
endpoint's prompt tokens), forced tool calls sent back with their outputs, ``previous_response_id``
and the store that serves it, ``text.format`` (the client's ``parse``), ``max_output_tokens`` and
the 400s. The tiny model's weights are random: tests check structure, and what must hold of the
content (a forced call's arguments, a schema's JSON) is the grammar's doing.
"""

import json
from typing import Literal

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("llguidance")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")

from openai.types.responses import Response, ResponseStreamEvent  # noqa: E402
from pydantic import BaseModel, TypeAdapter  # noqa: E402

from nanoengine.serve_responses import ResponseStore  # noqa: E402
from tests.test_serve import in_process_server  # noqa: E402

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city", "strict": True,
           "parameters": {"type": "object", "required": ["city", "unit"], "additionalProperties": False,
                          "properties": {"city": {"enum": ["Paris", "Rome"]},  # a call of bounded length
                                         "unit": {"enum": ["celsius", "fahrenheit"]}}}}
CLOCK = {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {}}}
ASK = "What is the weather in Paris?"
# Output the grammar keeps from ending early: a string of at least 200 characters.
LONG = {"format": {"type": "json_schema", "name": "long", "schema": {"type": "string", "minLength": 200}}}
# Output the grammar ends soon: the response completes ("stop"), whatever the weights.
SHORT_SCHEMA = {"type": "object", "required": ["answer"], "additionalProperties": False,
                "properties": {"answer": {"enum": ["yes", "no"]}}}
SHORT = {"format": {"type": "json_schema", "name": "short", "schema": SHORT_SCHEMA, "strict": True}}
EVENT = TypeAdapter(ResponseStreamEvent)


class Verdict(BaseModel):
    answer: Literal["yes", "no"]
    sure: bool


@pytest.fixture(scope="module")
def served(tiny_models):
    with in_process_server(tiny_models["llama"], max_model_len=512) as (url, engine):
        yield url, engine


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served[0]}/v1", api_key="x", max_retries=0, timeout=60)


def validated(response) -> Response:
    """The response as the SDK's ``Response`` type validates it (the client itself only constructs)."""
    return Response.model_validate(response.to_dict())


def chat_prompt_tokens(client, messages: list[dict], **body) -> int:
    return client.chat.completions.create(model="tiny", messages=messages, max_tokens=1, **body).usage.prompt_tokens


def streamed(events) -> list:
    """Every event, each validated by the SDK's event types, numbered 0, 1, 2, ... in order."""
    events = [EVENT.validate_python(event.to_dict(warnings=False)) for event in events]  # the helper's are subclasses
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    return events


def test_a_response_has_the_sdks_shape_and_reads_its_input_as_the_chat_endpoint_does(client):
    response = client.responses.create(model="tiny", input=ASK, instructions="Be brief.", max_output_tokens=8,
                                       temperature=0, metadata={"team": "a"})
    response = validated(response)
    assert response.id.startswith("resp_") and response.object == "response" and response.model == "tiny"
    assert response.status in ("completed", "incomplete") and response.metadata == {"team": "a"}
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    [part] = message.content
    assert part.type == "output_text" and part.annotations == []
    assert response.output_text == part.text
    usage = response.usage
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens and 1 <= usage.output_tokens <= 8
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": ASK}]
    assert usage.input_tokens == chat_prompt_tokens(client, messages)
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    assert part.text == chat.choices[0].message.content  # greedy: the same tokens as the chat endpoint's


def test_streamed_events_are_the_sdks_types_and_add_up_to_the_stored_response(client):
    events = streamed(client.responses.create(model="tiny", input=ASK, max_output_tokens=6, text=LONG, stream=True))
    last = events[-1]
    assert last.type == f"response.{last.response.status}"
    [message] = last.response.output
    types = [e.type for e in events[2:-1]]
    assert types[:2] == ["response.output_item.added", "response.content_part.added"]
    assert types[-3:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert all(e.item_id == message.id and e.output_index == 0 and e.content_index == 0 for e in deltas)
    assert "".join(e.delta for e in deltas) == message.content[0].text
    assert last.response.usage.output_tokens == 6 and last.response.status == "incomplete"
    assert client.responses.retrieve(last.response.id).to_dict() == last.response.to_dict()


def test_a_response_that_hits_max_output_tokens_is_incomplete(client):
    response = validated(client.responses.create(model="tiny", input=ASK, max_output_tokens=3, text=LONG))
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].status == "incomplete" and response.usage.output_tokens == 3
    events = streamed(client.responses.create(model="tiny", input=ASK, max_output_tokens=3, text=LONG, stream=True))
    assert events[-1].type == "response.incomplete" and events[-1].response.incomplete_details.reason == \
        "max_output_tokens"


def test_the_clients_stream_helper_gives_the_final_response(client):
    with client.responses.stream(model="tiny", input=ASK, text=SHORT) as stream:
        events = streamed(stream)
        final = stream.get_final_response()
    assert final.status == "completed" and events[-1].type == "response.completed"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert final.output_text == text
    jsonschema.validate(json.loads(text), SHORT_SCHEMA)


def test_the_clients_parse_returns_the_pydantic_object(client):
    response = client.responses.parse(model="tiny", input="Is it raining?", text_format=Verdict)
    assert response.status == "completed"
    assert isinstance(response.output_parsed, Verdict)
    assert response.output_parsed == Verdict.model_validate_json(response.output_text)


def test_a_forced_function_call_and_its_output_sent_back(client):
    first = validated(client.responses.create(model="tiny", input=ASK, tools=[WEATHER, CLOCK], max_output_tokens=96,
                                              tool_choice={"type": "function", "name": "get_weather"}))
    assert first.status == "completed" and first.tool_choice.name == "get_weather"
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])

    returned = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}
    second = validated(client.responses.create(model="tiny", input=[{"role": "user", "content": ASK},
                                                                     call.to_dict(), returned],
                                               tools=[WEATHER, CLOCK], tool_choice="none", max_output_tokens=4))
    assert [item.type for item in second.output] == ["message"]
    chat_call = {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    assert second.usage.input_tokens == chat_prompt_tokens(client, [
        {"role": "user", "content": ASK}, {"role": "assistant", "content": None, "tool_calls": [chat_call]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 C"}], tool_choice="none",
        tools=[{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in (WEATHER, CLOCK)])


def test_a_streamed_forced_call_gives_its_arguments_in_deltas(client):
    """``required`` with ``parallel_tool_calls: false``: exactly one call, whatever the sampled tokens
    (``required`` alone lets the model make several)."""
    events = streamed(client.responses.create(model="tiny", input=ASK, tools=[WEATHER], tool_choice="required",
                                              parallel_tool_calls=False, max_output_tokens=96, stream=True))
    final = events[-1].response
    assert final.status == "completed"
    [call] = final.output
    deltas = [e for e in events if e.type == "response.function_call_arguments.delta"]
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert all(e.item_id == call.id and e.output_index == 0 for e in deltas + [done])
    assert "".join(e.delta for e in deltas) == done.arguments == call.arguments
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])


def test_previous_response_id_continues_the_conversation_as_its_items_sent_back_would(client):
    first = client.responses.create(model="tiny", input=ASK, instructions="Be brief.", max_output_tokens=4)
    second = client.responses.create(model="tiny", input="And in Rome?", previous_response_id=first.id,
                                     max_output_tokens=4)
    assert validated(second).previous_response_id == first.id
    # The earlier input and output come first; its instructions are not carried on, as OpenAI's are not.
    resent = client.responses.create(model="tiny", max_output_tokens=4, input=[
        {"role": "user", "content": ASK}, *(item.to_dict() for item in first.output),
        {"role": "user", "content": "And in Rome?"}])
    assert second.usage.input_tokens == resent.usage.input_tokens == chat_prompt_tokens(client, [
        {"role": "user", "content": ASK}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And in Rome?"}])
    third = client.responses.create(model="tiny", input="And in Oslo?", previous_response_id=second.id,
                                    max_output_tokens=4)
    assert third.usage.input_tokens == chat_prompt_tokens(client, [  # the first response's items too
        {"role": "user", "content": ASK}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And in Rome?"}, {"role": "assistant", "content": second.output_text},
        {"role": "user", "content": "And in Oslo?"}])


def test_include_logprobs_gives_each_output_tokens_logprob_whole_and_streamed(client):
    asked = dict(model="tiny", input=ASK, max_output_tokens=5, text=LONG, temperature=0)
    plain = validated(client.responses.create(**asked))
    assert plain.output[0].content[0].logprobs == []
    response = validated(client.responses.create(**asked, include=["message.output_text.logprobs"], top_logprobs=2))
    [part] = response.output[0].content
    assert part.text == plain.output_text and len(part.logprobs) == response.usage.output_tokens == 5
    assert all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in part.logprobs)
    events = streamed(client.responses.create(**asked, top_logprobs=2, stream=True))
    deltas = [lp.model_dump() for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    final = events[-1].response.output[0].content[0].logprobs
    assert [(lp["token"], lp["logprob"]) for lp in deltas] == [(lp.token, lp.logprob) for lp in final]
    assert [(lp.token, lp.logprob) for lp in final] == [(lp.token, lp.logprob) for lp in part.logprobs]


def test_fields_that_change_nothing_here_are_accepted_and_change_nothing(client):
    asked = dict(model="tiny", input=ASK, max_output_tokens=6, temperature=0)
    plain = client.responses.create(**asked)
    ignored = client.responses.create(**asked, user="u1", safety_identifier="s1", service_tier="auto",
                                      prompt_cache_key="k", prompt_cache_retention="24h", truncation="disabled",
                                      background=False, reasoning={"effort": "low", "summary": "auto"},
                                      text={"format": {"type": "text"}, "verbosity": "medium"},
                                      include=["reasoning.encrypted_content", "web_search_call.results"])
    assert ignored.output_text == plain.output_text and ignored.usage == plain.usage


def test_a_failed_step_is_a_failed_response_and_nothing_is_kept(served, client, monkeypatch):
    def failing_run(*args):
        raise RuntimeError("injected fault")
    monkeypatch.setattr(served[1].model_runner, "run", failing_run)
    with pytest.raises(openai.InternalServerError, match="injected fault"):
        client.responses.create(model="tiny", input=ASK, max_output_tokens=2)
    events = streamed(client.responses.create(model="tiny", input=ASK, max_output_tokens=2, stream=True))
    failed = events[-1]
    assert failed.type == "response.failed" and failed.response.status == "failed"
    assert failed.response.error.code == "server_error" and "injected fault" in failed.response.error.message
    monkeypatch.undo()
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(failed.response.id)
    assert client.responses.create(model="tiny", input=ASK, max_output_tokens=2, text=LONG).status == "incomplete"


def test_an_unknown_previous_response_id_is_a_404_naming_it(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="tiny", input=ASK, previous_response_id="resp_nowhere")
    assert e.value.body["param"] == "previous_response_id" and "resp_nowhere" in e.value.body["message"]
    assert e.value.body["type"] == "invalid_request_error"


def test_store_false_keeps_nothing_and_delete_forgets(client):
    unkept = client.responses.create(model="tiny", input=ASK, max_output_tokens=2, store=False)
    assert unkept.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)
    kept = client.responses.create(model="tiny", input=ASK, max_output_tokens=2)
    assert kept.store is True and client.responses.retrieve(kept.id).to_dict() == kept.to_dict()
    client.responses.delete(kept.id)
    for forgotten in (lambda: client.responses.retrieve(kept.id), lambda: client.responses.delete(kept.id),
                      lambda: client.responses.create(model="tiny", input=ASK, previous_response_id=kept.id)):
        with pytest.raises(openai.NotFoundError):
            forgotten()


def stored(store: ResponseStore, name: str, text: str = "x") -> None:
    store.put({"id": name, "output": [text]}, [])


def test_the_store_evicts_the_oldest_past_its_count_or_its_bytes():
    by_count = ResponseStore(max_responses=2)
    for name in ("a", "b", "c"):
        stored(by_count, name)
    assert list(by_count.responses) == ["b", "c"]
    record = len(json.dumps({"id": "a", "output": ["x"]})) + len(json.dumps([]))
    by_bytes = ResponseStore(max_bytes=2 * record)
    for name in ("a", "b", "c"):
        stored(by_bytes, name)
    assert list(by_bytes.responses) == ["b", "c"] and by_bytes.size == 2 * record
    stored(by_bytes, "d", "x" * 2 * record)  # larger than the whole store: not kept, nothing evicted for it
    assert list(by_bytes.responses) == ["b", "c"]
    assert by_bytes.delete("b") and not by_bytes.delete("b") and by_bytes.size == record
    nothing = ResponseStore(max_responses=0)  # --max-stored-responses 0
    stored(nothing, "a")
    assert nothing.get("a") is None and nothing.size == 0


def test_the_stores_bounds_are_flags_with_their_defaults():
    from nanoengine.serve_cli_args import make_parser
    parser = make_parser()
    defaults = parser.parse_args([])
    assert (defaults.max_stored_responses, defaults.max_stored_responses_bytes) == (1024, 64 << 20)
    args = parser.parse_args(["--max-stored-responses", "0", "--max-stored-responses-bytes", "4096"])
    assert (args.max_stored_responses, args.max_stored_responses_bytes) == (0, 4096)
    with pytest.raises(SystemExit):
        parser.parse_args(["--max-stored-responses", "-1"])


@pytest.mark.parametrize("body, param, message", [
    ({"tools": [{"type": "web_search"}]}, "tools", "tool 0 of type 'web_search' is not served here"),
    ({"tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "tool_choice", "a choice of type 'allowed_tools' is not served here"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nowhere"}}, "tool_choice",
     "'nowhere', which is not one of the tools"),  # the chat endpoint's check
    ({"input": [{"type": "reasoning", "summary": []}]}, "input", "item 0 of type 'reasoning' is not served here"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input",
     "part 0 of type 'input_image'"),
    ({"background": True}, "background", "a response is generated while its request is open"),
    ({"truncation": "auto"}, "truncation", "refused, not cut"),
    ({"max_output_tokens": 0}, "max_output_tokens", "greater than or equal to 1"),  # chat's max_completion_tokens
    ({"text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}, "text.format",
     "text.format.name: Field required"),
    ({"text": {"verbosity": "high"}}, "text.verbosity", 'only null or "medium"'),
    ({"input": "word " * 600}, "input", "more than max_model_len=512"),
    ({"max_output_tokens": 600}, "max_output_tokens", "the prompt or max_output_tokens"),
    ({"top_logprobs": 50}, "top_logprobs", "max_logprobs=20"),
    ({"web_search_options": {}}, "web_search_options", "Extra inputs are not permitted"),
    ({"temperature": "hot", "top_p": 3}, "temperature",  # every bad field named, each once
     "temperature: Input should be a valid number; top_p must be in (0, 1]"),
])
def test_a_request_that_cannot_be_served_is_a_400_in_the_responses_apis_names(served, body, param, message):
    response = httpx.post(f"{served[0]}/v1/responses", json={"input": ASK, "max_output_tokens": 4, **body}, timeout=30)
    error = response.json()["error"]
    assert response.status_code == 400 and error["type"] == "invalid_request_error", response.text
    assert error["param"] == param and message in error["message"], response.text
