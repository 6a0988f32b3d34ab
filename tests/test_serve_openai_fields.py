"""The request policy, through the official openai client against the real server: every field of
OpenAI's chat and completions APIs is declared, and sent once it is honoured (the penalties give
the tokens the offline engine gives), accepted and ignored as docs/serving.md's table says, or refused
with a 400 that says why. Also vLLM's extensions, ``GET /v1/models/{id}`` and the response shapes.
"""

import json
import logging
import os
import re

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from pydantic import ValidationError  # noqa: E402

from nanoengine import LLM, SamplingParams  # noqa: E402
from nanoengine.openai_chat_protocol import ChatCompletionRequest, ChatMessage  # noqa: E402
from nanoengine.openai_protocol import IGNORED, CompletionRequest  # noqa: E402
from tests.conftest import with_chat_template  # noqa: E402
from tests.test_serve import (REPO_ROOT, chat_prompt_ids, client, in_process_server, llm, model_name,  # noqa: E402,F401
                              offline, openai_error, server, server_log)

MESSAGES = [{"role": "developer", "content": "Answer briefly."}, {"role": "user", "content": "Name a colour.",
                                                                     "name": "ann"}]
AS_SYSTEM = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a colour."}]
# The tiny random model seldom repeats itself: biased towards a few tokens, it chooses among them,
# so the penalties decide every step.
BIAS = {t: 10.0 for t in (300, 301, 302, 17, 40)}
PENALTIES = dict(presence_penalty=0.5, frequency_penalty=0.7, logit_bias={str(t): b for t, b in BIAS.items()})
VLLM_EXTRAS = dict(top_k=40, min_p=0.05, repetition_penalty=1.2, min_tokens=3, ignore_eos=True, stop_token_ids=[7])
# Every field the policy accepts and ignores, each with a value that is accepted.
IGNORED_VALUES = dict(metadata={"team": "a"}, store=False, service_tier="auto", user="u1", safety_identifier="s1",
                      prompt_cache_key="k", prompt_cache_retention="24h", prompt_cache_options={"mode": "implicit"},
                      reasoning_effort="low", modalities=["text"], prediction={"type": "content", "content": "Blue"})


def offline_params(**fields) -> dict:
    fields = dict(fields)
    if "logit_bias" in fields:
        fields["logit_bias"] = {int(t): b for t, b in fields["logit_bias"].items()}
    return fields


def sdk_fields(typed_dict) -> set[str]:
    return {name for klass in typed_dict.__mro__ for name in getattr(klass, "__annotations__", {})}


def test_every_field_of_openais_chat_and_completions_apis_is_declared():
    from openai.types import completion_create_params
    from openai.types.chat import (ChatCompletionAssistantMessageParam, ChatCompletionDeveloperMessageParam,
                                   ChatCompletionSystemMessageParam, ChatCompletionToolMessageParam,
                                   ChatCompletionUserMessageParam, completion_create_params as chat_create_params)
    assert sdk_fields(chat_create_params.CompletionCreateParamsBase) <= ChatCompletionRequest.model_fields.keys()
    assert sdk_fields(completion_create_params.CompletionCreateParamsBase) <= CompletionRequest.model_fields.keys()
    messages = (ChatCompletionSystemMessageParam, ChatCompletionDeveloperMessageParam, ChatCompletionUserMessageParam,
                ChatCompletionAssistantMessageParam, ChatCompletionToolMessageParam)
    assert set().union(*map(sdk_fields, messages)) <= ChatMessage.model_fields.keys()


def test_chat_with_every_honoured_and_ignored_field_equals_offline(client, model_name, llm):
    sampled = dict(temperature=0.3, top_p=0.95, seed=3, n=2, stop=["\n\n"])
    response = client.chat.completions.create(
        model=model_name, messages=MESSAGES, max_completion_tokens=10, logprobs=True, top_logprobs=2,
        stream_options=None, tools=[], tool_choice="none", parallel_tool_calls=True, response_format={"type": "text"},
        **PENALTIES, **sampled, **IGNORED_VALUES,
        extra_body=dict(VLLM_EXTRAS, chat_template_kwargs={"enable_thinking": False}))
    expected = offline(llm, [chat_prompt_ids(llm, AS_SYSTEM)], max_tokens=10, logprobs=2,
                       **offline_params(**PENALTIES, **sampled, **VLLM_EXTRAS))[0]["outputs"]
    assert [c.message.content for c in response.choices] == [o["text"] for o in expected]
    assert [len(c.logprobs.content) for c in response.choices] == [len(o["token_ids"]) for o in expected]


def test_max_completion_tokens_wins_over_the_deprecated_max_tokens(client, model_name):
    for both in (dict(max_tokens=3, max_completion_tokens=6), dict(max_tokens=6, max_completion_tokens=3)):
        response = client.chat.completions.create(model=model_name, messages=MESSAGES, temperature=0,
                                                  extra_body={"ignore_eos": True}, **both)
        assert response.usage.completion_tokens == both["max_completion_tokens"]


def test_completion_with_every_field_equals_offline(client, model_name, llm):
    prompt = [5, 17, 17, 40, 5, 99, 300, 17]
    fields = dict(max_tokens=10, temperature=0, top_p=1.0, seed=1, n=1, stop=None, logprobs=1, **PENALTIES)
    response = client.completions.create(model=model_name, prompt=prompt, echo=False, best_of=1, suffix=None,
                                         user="u1", stream=False, extra_body=dict(repetition_penalty=1.3, min_tokens=2),
                                         **fields)
    params = offline_params(**fields, repetition_penalty=1.3, min_tokens=2)
    expected = offline(llm, [prompt], **params)[0]
    biased_only = offline(llm, [prompt], max_tokens=10, temperature=0, logit_bias=BIAS)[0]
    assert response.choices[0].text == expected["text"] != biased_only["text"]  # the penalties were applied
    streamed = client.completions.create(model=model_name, prompt=prompt, stream=True, stream_options={
        "include_usage": True}, extra_body=dict(repetition_penalty=1.3, min_tokens=2), **fields)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == expected["text"]


def test_vllms_output_fields_give_what_offline_gives(client, model_name, llm):
    """allowed_token_ids, bad_words, include_stop_str_in_output and skip_special_tokens, as vLLM's
    extensions: the completion equals the offline engine's with the same SamplingParams."""
    prompt = [5, 17, 17, 40, 5, 99, 300, 17]
    plain = offline(llm, [prompt], max_tokens=8, temperature=0, ignore_eos=True)[0]["outputs"][0]
    stop = plain["text"][len(plain["text"]) // 2:][:2]
    cases = [dict(allowed_token_ids=[300, 17, 40, 5]), dict(bad_words=[llm.tokenizer.decode(plain["token_ids"][:1])]),
             dict(stop=[stop], include_stop_str_in_output=True),
             dict(skip_special_tokens=False, allowed_token_ids=[llm.tokenizer.eos_token_id])]
    for extra in cases:
        expected = offline(llm, [prompt], max_tokens=8, temperature=0, ignore_eos=True, **extra)[0]["outputs"][0]
        response = client.completions.create(model=model_name, prompt=prompt, max_tokens=8, temperature=0,
                                             stop=extra.pop("stop", None), extra_body=dict(ignore_eos=True, **extra))
        assert response.choices[0].text == expected["text"] != plain["text"], extra  # each changed something
        assert response.choices[0].model_extra["stop_reason"] == expected["stop_reason"], extra
    assert llm.tokenizer.eos_token in expected["text"]  # written, not skipped
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model_name, prompt=prompt, max_tokens=2,
                                  extra_body=dict(allowed_token_ids=[10 ** 9]))
    assert "allowed_token_ids" in info.value.body["message"]


def test_truncate_prompt_tokens_cuts_a_long_prompt_as_offline_does(client, model_name, llm):
    """vLLM's truncate_prompt_tokens: the prompt's last k tokens, echoed as the model read them; a
    value it cannot take is a 400 naming it. spaces_between_special_tokens is taken as a bool."""
    document = "hello world " * 1000  # longer than max_model_len
    kept = llm.tokenizer.encode(document)[-12:]
    expected = offline(llm, [document], max_tokens=3, temperature=0, truncate_prompt_tokens=12)[0]
    assert expected["prompt_token_ids"] == kept
    response = client.completions.create(model=model_name, prompt=document, max_tokens=3, temperature=0, echo=True,
                                         extra_body=dict(truncate_prompt_tokens=12, spaces_between_special_tokens=False))
    assert response.usage.prompt_tokens == 12
    assert response.choices[0].text == llm.tokenizer.decode(kept) + expected["text"]
    chat = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": document}],
                                          max_tokens=2, extra_body=dict(truncate_prompt_tokens=30))
    assert chat.usage.prompt_tokens == 30
    for value in (0, -2, 10**6):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=model_name, prompt="hi", max_tokens=2,
                                      extra_body=dict(truncate_prompt_tokens=value))
        assert info.value.body["param"] == "truncate_prompt_tokens", value


def test_chat_continues_the_final_message_as_offline_does(client, model_name, llm):
    begun = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "The colour is"}]
    options = dict(add_generation_prompt=False, continue_final_message=True)
    response = client.chat.completions.create(model=model_name, messages=begun, max_tokens=6, temperature=0,
                                              extra_body=options)
    expected = llm.chat(begun, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False, **options)[0]
    assert response.choices[0].message.content == expected["outputs"][0]["text"]
    assert response.usage.prompt_tokens == len(llm.chat_prompt(begun, **options))
    # vLLM's echo: the begun reply in front of its continuation, whole and streamed
    echoed = client.chat.completions.create(model=model_name, messages=begun, max_tokens=6, temperature=0,
                                            extra_body={**options, "echo": True})
    streamed = client.chat.completions.create(model=model_name, messages=begun, max_tokens=6, temperature=0,
                                              stream=True, extra_body={**options, "echo": True})
    whole = "The colour is" + expected["outputs"][0]["text"]
    assert echoed.choices[0].message.content == whole == "".join(c.choices[0].delta.content or "" for c in streamed)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model_name, messages=begun, max_tokens=2,
                                       extra_body={"continue_final_message": True})
    assert info.value.body["param"] == "continue_final_message"
    # /tokenize counts what the chat endpoint sends
    tokenize = f"{client.base_url}".removesuffix("/v1/") + "/tokenize"
    assert httpx.post(tokenize, json={"messages": begun, **options}).json()["tokens"] == llm.chat_prompt(begun, **options)
    refused = httpx.post(tokenize, json={"messages": begun, "continue_final_message": True})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "continue_final_message"
    # with no generation prompt the reply goes on with the last message, in its role (vLLM's answer)
    asked = begun[:1]
    reply = client.chat.completions.create(model=model_name, messages=asked, max_tokens=2, temperature=0,
                                           extra_body={"add_generation_prompt": False})
    assert reply.choices[0].message.role == "user"
    assert response.choices[0].message.role == "assistant"


@pytest.mark.parametrize("path, field, value, reason", [
    ("chat/completions", "modalities", ["text", "audio"], "only text is generated"),
    ("chat/completions", "audio", {"voice": "alloy", "format": "wav"}, "only text is generated"),
    ("chat/completions", "functions", [{"name": "f"}], "functions are deprecated: use tools"),
    ("chat/completions", "function_call", {"name": "f"}, "functions are deprecated: use tools"),
    ("chat/completions", "web_search_options", {}, "there is no web search"),
    ("chat/completions", "verbosity", "high", "verbosity cannot be set"),
    ("completions", "suffix", "!", "no fill-in-the-middle"),
    ("completions", "best_of", 3, "not best_of"),
])
def test_a_value_nanoengine_cannot_honour_is_refused_saying_why(client, model_name, path, field, value, reason):
    create = client.chat.completions.create if path.startswith("chat") else client.completions.create
    body = {"messages": MESSAGES} if path.startswith("chat") else {"prompt": "hi"}
    with pytest.raises(openai.BadRequestError) as info:
        create(model=model_name, max_tokens=2, extra_body={field: value}, **body)
    error = info.value.body
    assert error["param"] == field and reason in error["message"]


def test_null_means_the_default(server, llm):
    nulls = dict.fromkeys(["temperature", "top_p", "n", "stream", "presence_penalty", "frequency_penalty", "stop",
                           "logit_bias", "logprobs", "user", "echo", "top_k", "min_p", "repetition_penalty",
                           "min_tokens", "ignore_eos"])
    body = {"prompt": "Tell me about the sea", "max_tokens": 6, "seed": 3, **nulls}
    response = httpx.post(f"{server}/v1/completions", json=body, timeout=30)
    assert response.status_code == 200, response.text
    expected = offline(llm, ["Tell me about the sea"], max_tokens=6, seed=3)[0]["text"]
    assert response.json()["choices"][0]["text"] == expected


def test_a_tool_is_checked_to_its_fields_and_the_400_names_them():
    body = {"messages": MESSAGES, "parallel_tool_calls": False,
            "tools": [{"type": "function"}, {"type": "function", "function": {"name": "no spaces"}}]}
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate(body)
    assert [e["loc"] for e in info.value.errors()] == [("tools", 0, "function"), ("tools", 1, "function", "name")]


def test_the_schema_names_every_bad_field_at_once(server):
    body = {"messages": [{"role": "user", "content": "hi"}], "presence_penalty": "high",
            "modalities": ["audio"], "top_k": "ten"}
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate(body)
    assert {e["loc"][0] for e in info.value.errors()} == {"presence_penalty", "modalities", "top_k"}
    # The HTTP 400's message is formatted by serve.py's handler; it names the first bad field at least.
    response = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=10)
    assert response.status_code == 400 and "presence_penalty" in response.json()["error"]["message"]


def test_an_assistant_message_returned_by_the_sdk_can_be_sent_back(client, model_name):
    messages = [{"role": "user", "content": "Hi."}]
    first = client.chat.completions.create(model=model_name, messages=messages, max_tokens=4, temperature=0)
    assert first.choices[0].message.refusal is None
    messages.append(first.choices[0].message)  # the SDK sends what it parsed, refusal: null included
    messages.append({"role": "user", "content": "And then?"})
    second = client.chat.completions.create(model=model_name, messages=messages, max_tokens=4, temperature=0)
    assert second.usage.prompt_tokens > first.usage.prompt_tokens
    # as a dict, the way agent frameworks keep history: annotations (null, or citations) come along
    messages[1] = {**first.choices[0].message.model_dump(), "annotations": [{"type": "url_citation"}]}
    again = client.chat.completions.create(model=model_name, messages=messages, max_tokens=4, temperature=0)
    assert again.usage.prompt_tokens == second.usage.prompt_tokens


def test_responses_carry_system_fingerprint_and_refusal_as_null(server):
    chat = httpx.post(f"{server}/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2}, timeout=30).json()
    assert chat["system_fingerprint"] is None and chat["choices"][0]["message"]["refusal"] is None
    completion = httpx.post(f"{server}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30).json()
    assert "system_fingerprint" in completion and completion["system_fingerprint"] is None


def test_models_retrieve_and_an_unknown_model_is_a_404_in_openais_shape(server, client, model_name):
    assert client.models.retrieve(model_name).id == model_name
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("no-such-model")
    assert info.value.status_code == 404 and info.value.body["param"] == "model"
    assert "no-such-model" in info.value.body["message"]


def test_ignored_fields_are_logged_at_debug_level(caplog):
    with caplog.at_level(logging.DEBUG, logger="nanoengine.openai_protocol"):
        ChatCompletionRequest.model_validate({"messages": MESSAGES, "store": True, "metadata": {"a": "b"}})
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert "store (nothing is stored)" in logged and "metadata" in logged and "name (" in logged


def test_the_serving_docs_table_lists_exactly_the_ignored_fields():
    with open(os.path.join(REPO_ROOT, "docs", "serving.md")) as f:
        readme = f.read()
    rows = readme[readme.index("| ignored field |"):].split("\n\n")[0].splitlines()[2:]
    assert {name for row in rows for name in re.findall(r"`(\w+)`", row.split("|")[1])} == IGNORED.keys()


# -- chat_template_kwargs reach the template: a Qwen3-like template on the tiny model -------------

THINKING_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                     "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and "
                     "not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")


@pytest.fixture(scope="module")
def thinking_model(tiny_models, tmp_path_factory) -> str:
    return with_chat_template(tiny_models["llama"], str(tmp_path_factory.mktemp("thinking") / "llama"),
                              THINKING_TEMPLATE)


def test_chat_template_kwargs_reach_the_chat_template(thinking_model):
    messages = [{"role": "user", "content": "Hi."}]
    llm = LLM(thinking_model, dtype="float32", device="cpu")
    plain = llm.chat_prompt(messages)
    no_thinking = llm.chat_prompt(messages, {"enable_thinking": False})
    assert llm.tokenizer.decode(no_thinking).endswith("<think>\n\n</think>\n\n") and no_thinking[:len(plain)] == plain
    greedy = SamplingParams(temperature=0, max_tokens=6)
    (chat,) = llm.chat(messages, greedy, use_tqdm=False, chat_template_kwargs={"enable_thinking": False})
    assert chat == {**llm.generate([no_thinking], greedy, use_tqdm=False)[0], "prompt": llm.tokenizer.decode(no_thinking)}
    with in_process_server(thinking_model) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=30)
        response = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0,
                                                  extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        assert response.usage.prompt_tokens == len(no_thinking)
        assert response.choices[0].message.content == llm.generate([no_thinking], greedy, use_tqdm=False)[0]["text"]
        with pytest.raises(openai.BadRequestError, match="chat_template_kwargs"):
            client.chat.completions.create(model="tiny", messages=messages, max_tokens=2,
                                           extra_body={"chat_template_kwargs": {"add_generation_prompt": False}})


# -- what vLLM's clients send besides OpenAI's fields ----------------------------------------------

def test_vllms_request_fields_are_honoured_or_refused_saying_why(server, client, model_name, llm):
    prompt = [5, 17, 17, 40, 5, 99, 300, 17]
    response = client.completions.create(model=model_name, prompt=prompt, max_tokens=3, temperature=0, logprobs=2,
                                         extra_body=dict(return_tokens_as_token_ids=True, request_id="abc-1",
                                                         priority=0, use_beam_search=False, length_penalty=0.5))
    assert response.id == "cmpl-abc-1"
    tokens = response.choices[0].logprobs.tokens
    assert tokens == [f"token_id:{t}" for t in offline(llm, [prompt], max_tokens=3, temperature=0)[0]["token_ids"]]
    assert all(key.startswith("token_id:") for top in response.choices[0].logprobs.top_logprobs for key in top)
    chat = client.chat.completions.create(model=model_name, messages=AS_SYSTEM, max_tokens=2, logprobs=True,
                                          extra_body=dict(return_tokens_as_token_ids=True, request_id="xyz"))
    assert chat.id == "chatcmpl-xyz" and chat.choices[0].logprobs.content[0].token.startswith("token_id:")
    with_bos = client.completions.create(model=model_name, prompt="hello", max_tokens=1)
    without = client.completions.create(model=model_name, prompt="hello", max_tokens=1,
                                        extra_body=dict(add_special_tokens=False))
    assert without.usage.prompt_tokens == len(llm.tokenizer.encode("hello", add_special_tokens=False))
    assert with_bos.usage.prompt_tokens == len(llm.tokenizer.encode("hello"))
    for path, field, value, reason in [("completions", "priority", 1, "first come, first served"),
                                       ("completions", "use_beam_search", True, "LLM.beam_search"),
                                       ("chat/completions", "chat_template", "{{ x }}", "the server's template (--chat-template)"),
                                       ("chat/completions", "add_special_tokens", True, "the chat template writes"),
                                       ("completions", "cache_salt", "s", "Extra inputs are not permitted")]:
        body = {"messages": AS_SYSTEM} if path.startswith("chat") else {"prompt": "hi"}
        error = httpx.post(f"{server}/v1/{path}", json={**body, "max_tokens": 2, field: value}, timeout=30).json()["error"]
        assert error["param"] == field and reason in error["message"], error


def test_what_agent_frameworks_send_back_in_messages_is_taken(server, tiny_models, tmp_path):
    """Anthropic-style cache_control hints (LiteLLM, LangChain) are accepted anywhere OpenAI's shapes
    allow them; an earlier reply's reasoning_content reaches a template that reads it."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}},
            "cache_control": {"type": "ephemeral"}}
    messages = [{"role": "system", "content": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
                 "cache_control": {"type": "ephemeral"}},
                {"role": "assistant", "content": "Hi.", "reasoning_content": "greet"},
                {"role": "user", "content": "Hello"}]
    body = {"messages": messages, "max_tokens": 2, "tools": [tool], "tool_choice": "required"}
    assert httpx.post(f"{server}/v1/chat/completions", json=body, timeout=30).status_code == 200
    template = "{% for m in messages %}{{ m.role }}:{{ m.reasoning_content or '' }}|{{ m.content }}\n{% endfor %}"
    model = with_chat_template(tiny_models["llama"], str(tmp_path / "reasoning"), template)
    tokenizer = LLM(model, dtype="float32", max_model_len=64).tokenizer
    reasoning = ChatMessage.model_validate({"role": "assistant", "content": "Hi.", "reasoning": "greet"}).for_template()
    assert "assistant:greet|Hi." in tokenizer.apply_chat_template([reasoning], tokenize=False)


def test_stream_usage_can_be_continuous_and_stream_options_need_a_stream(server):
    body = {"prompt": "Hi", "max_tokens": 4, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=30) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 4 and counts[0] >= 1 and len(chunks) >= 3
    error = openai_error(httpx.post(f"{server}/v1/completions", json={**body, "stream": False}, timeout=30), 400)
    assert error["param"] == "stream_options" and "only with stream: true" in error["message"]


def test_small_vllm_endpoints_cors_and_the_fields_errors_name(server):
    assert httpx.get(f"{server}/ping").json() == {"status": "ok"} == httpx.post(f"{server}/ping").json()
    assert httpx.get(f"{server}/version").json()["version"]
    preflight = httpx.options(f"{server}/v1/chat/completions", headers={
        "Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST"})
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == "http://localhost:3000"
    for body, param in [({"max_completion_tokens": 0}, "max_completion_tokens"),
                        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"), ({"seed": 2**64}, "seed")]:
        error = openai_error(httpx.post(f"{server}/v1/chat/completions", json={"messages": AS_SYSTEM, **body},
                                        timeout=30), 400)
        assert error["param"] == param, error
    long = [{"role": "user", "content": "hello world " * 40000}]  # more characters than max_model_len could hold
    cut = httpx.post(f"{server}/v1/chat/completions", timeout=60,
                     json={"messages": long, "max_tokens": 2, "truncate_prompt_tokens": 50}).json()
    assert cut["usage"]["prompt_tokens"] == 50
