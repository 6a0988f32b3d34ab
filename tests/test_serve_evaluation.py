"""Evaluating a served model: the requests lm-evaluation-harness 0.4.13 sends to ``/v1/completions``
(its ``local-completions`` client: ``LocalCompletionsAPI._create_payload`` and ``parse_logprobs``),
answered with HF transformers' numbers on the same weights; batched prompts; ``echo``;
vLLM's ``prompt_logprobs``, ``/tokenize`` and ``/detokenize``; error lines in the server's log.

The server runs in the test process with a short context (64 tokens) and chunked prefill with a
small budget, so long prompts are scored in chunks and perplexity needs several windows.
lm-eval itself is not needed: the payloads and the windowing below are its, written out.
"""

import asyncio
import logging
import math

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from nanoengine import LLM, SamplingParams  # noqa: E402
from tests.test_sequence_groups import hf, hf_logprobs  # noqa: E402,F401
from tests.test_serve import in_process_server  # noqa: E402

MAX_MODEL_LEN = 64
# lm-eval's loglikelihood payload, whatever the prompt form.
LM_EVAL = {"model": "tiny", "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": True}
ITEMS = [("The capital of France is", " Paris"), ("Two plus two makes", " four"),
         ("A poem on the sea:", " waves and salt and wind")]


@pytest.fixture(scope="module")
def served(tiny_models):
    with in_process_server(tiny_models["llama"], max_model_len=MAX_MODEL_LEN, enable_chunked_prefill=True,
                           max_num_batched_tokens=32) as (url, engine):
        with httpx.Client(base_url=url, timeout=60) as http:
            yield http, engine


def completions(http, **body) -> dict:
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def lm_eval_parse(choice: dict, ctxlen: int) -> tuple[float, bool]:
    """lm-eval's ``parse_logprobs``: the continuation's logprob (the tokens past the context, less the
    one sampled token at the end) and whether each was the most likely."""
    token_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
    tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
    return sum(token_logprobs), all(lp == max(top.values()) for lp, top in zip(token_logprobs, tops))


def hf_loglikelihood(hf, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    rows = hf_logprobs(hf, context + continuation)[len(context) - 1:-1]
    target = torch.tensor(continuation)
    return rows.gather(1, target[:, None]).sum().item(), bool((rows.argmax(-1) == target).all())


def assert_prompt_scores_are_hfs(hf, tokenizer, logprobs: dict, token_ids: list[int]):
    """The legacy logprobs of an echoed prompt: null first, then HF's logprob of each token, with
    the token itself and the most likely one among its top alternatives."""
    expected = hf_logprobs(hf, token_ids)
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert logprobs["tokens"][:len(token_ids)] == [tokenizer.decode([t]) for t in token_ids]
    for i in range(1, len(token_ids)):
        token_logprob, top = logprobs["token_logprobs"][i], logprobs["top_logprobs"][i]
        assert token_logprob == pytest.approx(expected[i - 1, token_ids[i]].item(), abs=1e-3)
        assert top[logprobs["tokens"][i]] == token_logprob and 1 <= len(top) <= 2
        assert max(top.values()) == pytest.approx(expected[i - 1].max().item(), abs=1e-3)


@pytest.mark.parametrize("form", ["token-id lists", "strings"])
@pytest.mark.parametrize("batch_size", [1, 3])
def test_loglikelihood_requests_as_lm_eval_sends_them_get_hfs_numbers(served, hf, tokenizer, form, batch_size):
    http, _ = served
    encoded = [(tokenizer.encode(c), tokenizer.encode(x)) for c, x in ITEMS]
    for start in range(0, len(ITEMS), batch_size):
        batch = encoded[start:start + batch_size]
        prompts = [c + x for c, x in batch]
        if form == "strings":  # tokenized_requests=False: the ids decoded, one string alone at batch size 1
            prompts = [tokenizer.decode(p) for p in prompts]
            prompts = prompts[0] if batch_size == 1 else prompts
        response = completions(http, **LM_EVAL, prompt=prompts)
        choices = sorted(response["choices"], key=lambda c: c["index"])
        assert [c["index"] for c in choices] == list(range(len(batch)))
        for choice, (context, continuation) in zip(choices, batch):
            assert len(choice["logprobs"]["tokens"]) == len(context) + len(continuation) + 1  # and the sampled one
            assert_prompt_scores_are_hfs(hf, tokenizer, choice["logprobs"], context + continuation)
            loglikelihood, greedy = lm_eval_parse(choice, len(context))
            expected, expected_greedy = hf_loglikelihood(hf, context, continuation)
            assert loglikelihood == pytest.approx(expected, abs=1e-3) and greedy == expected_greedy
        assert response["usage"]["prompt_tokens"] == sum(len(c) + len(x) for c, x in batch)


def test_echo_with_max_tokens_0_scores_the_prompt_without_generating(served, hf, tokenizer):
    http, _ = served
    prompt = "Why do people like trains? Because"
    response = completions(http, prompt=prompt, echo=True, logprobs=1, max_tokens=0, temperature=0)
    (choice,) = response["choices"]
    token_ids = tokenizer.encode(prompt)
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["tokens"]) == len(token_ids) and response["usage"]["completion_tokens"] == 0
    assert_prompt_scores_are_hfs(hf, tokenizer, choice["logprobs"], token_ids)
    offsets = choice["logprobs"]["text_offset"]
    assert offsets[0] == 0 and all(prompt[o:].startswith(t) for o, t in zip(offsets, choice["logprobs"]["tokens"]))


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("prompts", [["Tell me about the sea", "A poem on"], [[1, 2, 3, 4], [5, 6, 7]]])
def test_echo_puts_each_prompt_before_its_choices(served, prompts, stream):
    http, engine = served
    greedy = dict(temperature=0, max_tokens=5, ignore_eos=True)
    plain = [c["text"] for c in completions(http, prompt=prompts, **greedy)["choices"]]
    if stream:
        texts = ["", ""]
        with http.stream("POST", "/v1/completions", json={"prompt": prompts, "echo": True, "stream": True,
                                                         **greedy}) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    (choice,) = httpx.Response(200, content=line[6:]).json()["choices"]
                    texts[choice["index"]] += choice["text"]
    else:
        texts = [c["text"] for c in completions(http, prompt=prompts, echo=True, **greedy)["choices"]]
    # A text prompt is echoed as sent, a token-id prompt as its tokens decode.
    echoed = [p if isinstance(p, str) else engine.tokenizer.decode(p) for p in prompts]
    assert texts == [e + t for e, t in zip(echoed, plain)]


@pytest.mark.parametrize("body", [dict(prompt="Tell me about the sea", stop=["QQQQQ"]),  # text held back
                                  dict(prompt="日本の首都は、", echo=True)])  # characters split across tokens
def test_streamed_logprobs_and_text_offsets_are_the_whole_responses(served, body):
    http, _ = served
    body = dict(body, temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    whole = completions(http, **body)["choices"][0]["logprobs"]
    streamed = {"tokens": [], "token_logprobs": [], "text_offset": []}
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        for line in response.iter_lines():
            if line.startswith("data: {") and (logprobs := httpx.Response(200, content=line[6:]).json()[
                    "choices"][0]["logprobs"]):
                for key in streamed:
                    streamed[key] += logprobs[key]
    assert streamed == {key: whole[key] for key in streamed}


def rolling_windows(tokens: list[int], prefix_token: int, max_length: int) -> list[tuple[list[int], list[int]]]:
    """lm-eval's ``loglikelihood_rolling`` windows (``get_rolling_token_windows`` with context_len 1,
    then ``make_disjoint_window``) for ``max_length``: (context, continuation) pairs that predict
    every token once, each at most ``max_length - 1`` tokens, the first after ``prefix_token``."""
    max_seq_len = max_length - 2  # lm-eval keeps one token for generation, and one for context
    first = min(max_seq_len, len(tokens))
    windows, predicted = [([prefix_token], tokens[:first])], first
    while predicted < len(tokens):
        end = predicted + min(len(tokens) - predicted, max_seq_len)
        context = tokens[end - max_seq_len - 1:end - 1]
        continuation = tokens[predicted:end]
        windows.append((context[:len(context) - (len(continuation) - 1)], continuation))
        predicted = end
    return windows


def test_perplexity_of_a_document_longer_than_the_context_is_scored_in_lm_evals_windows(served, hf, tokenizer):
    http, _ = served
    with open("tests/data/perplexity_text.md") as f:
        tokens = tokenizer.encode(f.read()[:700])
    windows = rolling_windows(tokens, tokenizer.eos_token_id, MAX_MODEL_LEN)
    assert len(tokens) > 2 * MAX_MODEL_LEN and [t for _, x in windows for t in x] == tokens
    assert max(len(c) + len(x) for c, x in windows) == MAX_MODEL_LEN - 1  # with the sampled token: the whole context
    ours = expected = 0.0
    for context, continuation in windows:  # lm-eval sends one window per request, as a list of one token-id list
        (choice,) = completions(http, **LM_EVAL, prompt=[context + continuation])["choices"]
        ours += lm_eval_parse(choice, len(context))[0]
        expected += hf_loglikelihood(hf, context, continuation)[0]
    assert ours == pytest.approx(expected, abs=1e-3)
    assert math.exp(-ours / len(tokens)) == pytest.approx(math.exp(-expected / len(tokens)), rel=1e-3)  # perplexity


def test_batched_prompts_with_n_samples_are_numbered_prompt_major_streaming_and_not(served, tiny_models):
    http, _ = served
    prompts, sampled = ["A poem on coffee", "The history of trains"], dict(temperature=0.3, max_tokens=8, seed=4)
    llm = LLM(tiny_models["llama"], dtype="float32")
    expected = [o["text"] for out in llm.generate(prompts, SamplingParams(n=3, **sampled), use_tqdm=False)
                for o in out["outputs"]]
    response = completions(http, prompt=prompts, n=3, **sampled)
    assert [c["index"] for c in response["choices"]] == list(range(6))
    assert [c["text"] for c in response["choices"]] == expected
    texts, finished = [""] * 6, [0] * 6
    with http.stream("POST", "/v1/completions", json={"prompt": prompts, "n": 3, "stream": True, **sampled}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                (choice,) = httpx.Response(200, content=line[6:]).json()["choices"]
                texts[choice["index"]] += choice["text"]
                finished[choice["index"]] += choice["finish_reason"] is not None
    assert texts == expected and finished == [1] * 6


BAD_PROMPTS = [[1, "a"], [], [[]], [1.5], {"text": "hi"}, [["nested", "strings"]], [[1, 2], [10 ** 9]], ["ok", ""],
               [[1] * (MAX_MODEL_LEN + 1)], True]


@pytest.mark.parametrize("prompt", BAD_PROMPTS, ids=map(repr, BAD_PROMPTS))
def test_a_bad_prompt_shape_is_a_400_naming_prompt_and_queues_nothing(served, prompt):
    http, engine = served
    before = engine.counters["prompt_tokens"]
    response = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt", response.text
    assert response.json()["error"]["message"].startswith("prompt")
    assert engine.counters["prompt_tokens"] == before  # the good prompts of the batch were not queued either
    assert completions(http, prompt=["still", "serving"], max_tokens=2)["usage"]["completion_tokens"] == 4


def test_async_engine_queues_a_batch_all_or_none(tiny_models):
    from nanoengine.serve_async_engine import AsyncLLMEngine
    engine = AsyncLLMEngine(tiny_models["llama"], dtype="float32", device="cpu")
    try:
        with pytest.raises(ValueError, match="vocabulary"):
            asyncio.run(engine.add_requests([[1, 2, 3], [10 ** 9]], SamplingParams(max_tokens=2)))
        assert not engine.engine.requests and not engine.engine.has_unfinished_requests()
    finally:
        engine.shutdown()


def test_prompt_logprobs_extension_has_vllms_shape_on_completions_and_chat(served, hf, tokenizer):
    http, engine = served
    prompt = "The history of the sea"
    (choice,) = completions(http, prompt=prompt, max_tokens=2, temperature=0, prompt_logprobs=2)["choices"]
    token_ids = tokenizer.encode(prompt)
    expected = hf_logprobs(hf, token_ids)
    assert choice["prompt_logprobs"][0] is None and len(choice["prompt_logprobs"]) == len(token_ids)
    for i, entries in enumerate(choice["prompt_logprobs"][1:], start=1):
        own = entries[str(token_ids[i])]
        assert own["logprob"] == pytest.approx(expected[i - 1, token_ids[i]].item(), abs=1e-3)
        assert own["decoded_token"] == tokenizer.decode([token_ids[i]])
        top2 = expected[i - 1].topk(2)
        by_rank = {e["rank"]: (int(t), e["logprob"]) for t, e in entries.items() if e["rank"] is not None}
        assert [by_rank[r][0] for r in (1, 2)] == top2.indices.tolist()
        assert own["rank"] in (None, 1, 2) and (own["rank"] is None) == (token_ids[i] not in top2.indices.tolist())

    messages = [{"role": "user", "content": "Name a colour."}]
    response = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2, "prompt_logprobs": 0})
    chat_ids = engine.chat_prompt(messages)
    assert response.json()["prompt_logprobs"][0] is None and len(response.json()["prompt_logprobs"]) == len(chat_ids)
    streamed = http.post("/v1/completions", json={"prompt": prompt, "stream": True, "prompt_logprobs": 1})
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "prompt_logprobs"


def test_tokenize_and_detokenize_split_text_as_the_server_does(served, tokenizer):
    http, engine = served
    text = "Tokenize this, please."
    tokenized = http.post("/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    assert tokenized == {"count": len(tokenizer.encode(text)), "max_model_len": MAX_MODEL_LEN,
                         "tokens": tokenizer.encode(text), "token_strs": tokenizer.convert_ids_to_tokens(
                             tokenizer.encode(text))}
    assert http.post("/detokenize", json={"tokens": tokenized["tokens"]}).json() == {"prompt": text}
    messages = [{"role": "user", "content": text}]
    chat = http.post("/tokenize", json={"messages": messages}).json()
    assert chat["tokens"] == engine.chat_prompt(messages) and chat["token_strs"] is None
    response = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
    assert response.json()["usage"]["prompt_tokens"] == chat["count"]
    long = http.post("/tokenize", json={"prompt": "word " * 100}).json()  # counted, not refused
    assert long["count"] > MAX_MODEL_LEN
    for path, body, param in [("/detokenize", {"tokens": [10 ** 9]}, "tokens"), ("/tokenize", {}, "prompt"),
                              ("/tokenize", {"prompt": "a", "messages": messages}, "prompt")]:
        response = http.post(path, json=body)
        assert response.status_code == 400 and response.json()["error"]["param"] == param


def test_every_error_response_is_one_log_line_with_its_request_id(served, caplog):
    http, _ = served
    with caplog.at_level(logging.WARNING, logger="nanoengine.serve_request_log"):
        response = http.post("/v1/completions", json={"prompt": [[1], "x"]}, headers={"X-Request-Id": "eval-42"})
        good = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
        missing = http.get("/v1/nothing-here")
    assert response.status_code == 400 and response.headers["x-request-id"] == "eval-42"
    assert good.status_code == 200 and len(good.headers["x-request-id"]) == 32  # one of the server's own
    lines = [r.getMessage() for r in caplog.records if r.name == "nanoengine.serve_request_log"]
    assert len(lines) == 2, lines
    assert lines[0].startswith("eval-42 POST /v1/completions 400 param=prompt: prompt: must be a string")
    assert lines[1].startswith(f"{missing.headers['x-request-id']} GET /v1/nothing-here 404 param=None: Not Found")
