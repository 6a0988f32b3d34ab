"""The server's n, logprobs and stop_token_ids, through the official openai client, against the
offline ``LLM.generate`` on the same weights (the server fixtures are tests/test_serve.py's)."""

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")

from tests.test_serve import (PROMPTS, chat_prompt_ids, client, llm, model_name, offline, server,  # noqa: E402,F401
                              server_log)

# A low temperature: the samples differ, and float32 noise between batch shapes moves no token.
SAMPLED = dict(temperature=0.3, max_tokens=12, seed=4)


def test_n_choices_equal_offline_samples_streaming_and_not(client, model_name, llm):
    expected = [o["text"] for o in offline(llm, PROMPTS[:1], n=3, **SAMPLED)[0]["outputs"]]
    assert len(set(expected)) > 1
    response = client.completions.create(model=model_name, prompt=PROMPTS[0], n=3, **SAMPLED)
    assert [c.index for c in response.choices] == [0, 1, 2] and [c.text for c in response.choices] == expected
    assert response.usage.completion_tokens == sum(len(o["token_ids"]) for o in offline(
        llm, PROMPTS[:1], n=3, **SAMPLED)[0]["outputs"])

    chunks = list(client.completions.create(model=model_name, prompt=PROMPTS[0], n=3, stream=True,
                                            stream_options={"include_usage": True}, **SAMPLED))
    texts, finishes = ["", "", ""], [[], [], []]
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] += choice.text
        if choice.finish_reason:
            finishes[choice.index].append(choice.finish_reason)
    assert texts == expected and finishes == [["length"]] * 3
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == response.usage.completion_tokens
    assert sum(c.usage is not None for c in chunks) == 1


def test_chat_n_choices_stream_a_role_each(client, model_name, llm):
    messages = [{"role": "user", "content": "Say something."}]
    expected = [o["text"] for o in offline(llm, [chat_prompt_ids(llm, messages)], n=2, **SAMPLED)[0]["outputs"]]
    response = client.chat.completions.create(model=model_name, messages=messages, n=2, **SAMPLED)
    assert [c.message.content for c in response.choices] == expected
    chunks = list(client.chat.completions.create(model=model_name, messages=messages, n=2, stream=True, **SAMPLED))
    roles = [c.choices[0].index for c in chunks if c.choices[0].delta.role == "assistant"]
    texts = ["", ""]
    for chunk in chunks:
        texts[chunk.choices[0].index] += chunk.choices[0].delta.content or ""
    assert sorted(roles) == [0, 1] and texts == expected


def test_completion_logprobs_equal_offline(client, model_name, llm):
    (sample,) = offline(llm, PROMPTS[1:2], temperature=0, max_tokens=6, logprobs=2)[0]["outputs"]
    for stream in (False, True):
        response = client.completions.create(model=model_name, prompt=PROMPTS[1], temperature=0, max_tokens=6,
                                             logprobs=2, stream=stream)
        choices = [c.choices[0] for c in response if c.choices[0].logprobs] if stream else response.choices
        token_logprobs = [lp for c in choices for lp in c.logprobs.token_logprobs]
        tops = [top for c in choices for top in c.logprobs.top_logprobs]
        assert token_logprobs == pytest.approx([d[t] for t, d in zip(sample["token_ids"], sample["logprobs"])],
                                               abs=1e-5)
        assert all(2 <= len(top) <= 3 for top in tops) and len(tops) == 6
        tokens = [t for c in choices for t in c.logprobs.tokens]
        assert tokens == [llm.tokenizer.decode([t]) for t in sample["token_ids"]]


def test_chat_logprobs_have_openais_shape(client, model_name, llm):
    messages = [{"role": "user", "content": "Count to three."}]
    (sample,) = offline(llm, [chat_prompt_ids(llm, messages)], temperature=0, max_tokens=5, logprobs=3)[0]["outputs"]
    response = client.chat.completions.create(model=model_name, messages=messages, temperature=0, max_tokens=5,
                                              logprobs=True, top_logprobs=3)
    content = response.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx(
        [d[t] for t, d in zip(sample["token_ids"], sample["logprobs"])], abs=1e-5)
    for entry, token_id, top in zip(content, sample["token_ids"], sample["logprobs"]):
        assert entry.token == llm.tokenizer.decode([token_id]) and entry.bytes == list(entry.token.encode())
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(sorted(top.values(), reverse=True)[:3],
                                                                        abs=1e-5)


def test_stop_token_ids_extension_equals_offline(client, model_name, llm):
    full = offline(llm, PROMPTS[2:3], temperature=0, max_tokens=12, ignore_eos=True)[0]
    stop_id = full["token_ids"][3]
    expected = offline(llm, PROMPTS[2:3], temperature=0, max_tokens=12, stop_token_ids=[stop_id])[0]
    response = client.completions.create(model=model_name, prompt=PROMPTS[2], temperature=0, max_tokens=12,
                                         extra_body={"stop_token_ids": [stop_id]})
    assert response.choices[0].text == expected["text"] and response.choices[0].finish_reason == "stop"
    assert response.usage.completion_tokens == len(expected["token_ids"]) < 12
