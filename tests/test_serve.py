"""The OpenAI-compatible server, run for real: a subprocess on 127.0.0.1 serving a tiny model,
driven by the official openai client (and httpx for raw HTTP). Greedy outputs are checked
against the offline ``LLM.generate`` on the same weights. Also: ``/metrics``, the command line,
and the server's missing dependencies."""

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from typing import Iterator

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
prometheus_parser = pytest.importorskip("prometheus_client.parser")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("aiohttp")  # the server fixture starts it through bench_serving.py, an aiohttp client

from nanoengine import LLM, SamplingParams  # noqa: E402

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = [f"{start} {topic}" for start in ("Tell me about", "The history of", "Why do people like", "A poem on")
           for topic in ("the sea", "mountains", "coffee", "trains")]  # 16 distinct prompts
GREEDY = dict(temperature=0, max_tokens=24)


@pytest.fixture(scope="module")
def server_log(tmp_path_factory):
    return tmp_path_factory.mktemp("serve") / "server.log"


@pytest.fixture(scope="module")
def server(tiny_models, server_log):
    from bench_serving import nanoengine_server
    args = ["--model", tiny_models["llama"], "--dtype", "float32", "--device", "cpu", "--served-model-name",
            "tiny-served", "--enforce-eager", "--access-log"]
    with open(server_log, "w+") as log:
        try:
            with nanoengine_server(args, output=log) as url:
                yield url
        except SystemExit as e:  # it exited before it was healthy
            log.seek(0)
            pytest.fail(f"{e}:\n{log.read()}")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def model_name(client):
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(tiny_models["llama"], dtype="float32")


def offline(llm, prompts, **params) -> list[dict]:
    return llm.generate(prompts, SamplingParams(**params), use_tqdm=False)


def chat_prompt_ids(llm, messages) -> list[int]:
    text = llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return llm.tokenizer.encode(text, add_special_tokens=False)


def wait_for_idle_stats(server, timeout: float = 10) -> dict:
    deadline = time.monotonic() + timeout
    while (stats := httpx.get(f"{server}/stats", timeout=5).json())["kvcache_blocks_in_use"] != 0:
        assert time.monotonic() < deadline, f"KV blocks still in use: {stats}"
        time.sleep(0.05)
    return stats


def test_health_and_models(server, client):
    assert httpx.get(f"{server}/health", timeout=5).status_code == 200
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny-served"]


def test_greedy_completion_equals_offline_generate(client, model_name, llm):
    expected = offline(llm, PROMPTS[:1], **GREEDY)[0]
    response = client.completions.create(model=model_name, prompt=PROMPTS[0], **GREEDY)
    choice = response.choices[0]
    assert choice.text == expected["text"] and choice.finish_reason == expected["finish_reason"]
    prompt_tokens = len(llm.tokenizer.encode(PROMPTS[0]))
    assert response.usage.prompt_tokens == prompt_tokens
    assert response.usage.completion_tokens == len(expected["token_ids"])
    assert response.usage.total_tokens == prompt_tokens + len(expected["token_ids"])


def test_streamed_completion_concatenates_to_offline_text(client, model_name, llm):
    expected = offline(llm, PROMPTS[1:2], **GREEDY)[0]
    chunks = list(client.completions.create(model=model_name, prompt=PROMPTS[1], stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks) == expected["text"]
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_chat_completion_uses_the_chat_template(client, model_name, llm):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    expected = offline(llm, [chat_prompt_ids(llm, messages)], **GREEDY)[0]
    response = client.chat.completions.create(model=model_name, messages=messages, **GREEDY)
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == expected["text"]
    assert response.usage.prompt_tokens == len(chat_prompt_ids(llm, messages))

    chunks = list(client.chat.completions.create(model=model_name, messages=messages, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected["text"]
    assert chunks[-1].usage.completion_tokens == len(expected["token_ids"])


def test_stop_string_cuts_the_text_and_frees_the_request(server, client, model_name, llm):
    text = offline(llm, PROMPTS[2:3], **GREEDY)[0]["text"]
    stop = text[len(text) // 2:len(text) // 2 + 3]
    expected = text[:text.find(stop)]
    response = client.completions.create(model=model_name, prompt=PROMPTS[2], stop=[stop, "\x00never"], **GREEDY)
    assert response.choices[0].text == expected and response.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=model_name, prompt=PROMPTS[2], stop=stop, stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"
    wait_for_idle_stats(server)


def test_sixteen_concurrent_streaming_clients_get_their_own_outputs(server, model_name, llm):
    expected = [out["text"] for out in offline(llm, PROMPTS, **GREEDY)]

    async def one(client, prompt: str) -> str:
        stream = await client.completions.create(model=model_name, prompt=prompt, stream=True, **GREEDY)
        return "".join([chunk.choices[0].text async for chunk in stream])

    async def all_of_them() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0, timeout=30) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, p) for p in PROMPTS)), timeout=60)

    assert asyncio.run(all_of_them()) == expected
    wait_for_idle_stats(server)


def test_client_that_disconnects_mid_stream_is_aborted(server, client, model_name):
    # ignore_eos: nothing but max_tokens (or the abort) can end this request.
    params = dict(temperature=0, max_tokens=1000, extra_body={"ignore_eos": True})
    before = wait_for_idle_stats(server)
    stream = client.completions.create(model=model_name, prompt=PROMPTS[3], stream=True, **params)
    for _, _chunk in zip(range(3), stream):
        pass
    assert httpx.get(f"{server}/stats", timeout=5).json()["kvcache_blocks_in_use"] > 0
    stream.close()
    after = wait_for_idle_stats(server)
    assert after["generated_tokens"] - before["generated_tokens"] < params["max_tokens"]


BAD_REQUESTS = [
    ("completions", {"max_tokens": 4}),  # no prompt
    ("chat/completions", {"max_tokens": 4}),  # no messages
    ("chat/completions", {"messages": []}),
    ("chat/completions", {"messages": [{"role": "user"}]}),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}),
    ("completions", {"prompt": 42}),
    ("completions", {"prompt": ["two", 2]}),  # none of the four prompt forms
    ("completions", {"prompt": ""}),
    ("completions", {"prompt": [10 ** 9]}),  # not a token id
    ("completions", {"prompt": "hi", "max_tokens": "ten"}),
    ("completions", {"prompt": "hi", "temperature": "hot"}),
    ("completions", {"prompt": "hi", "stream": "yes"}),
    ("completions", {"prompt": "hi", "temperature": -1}),
    ("completions", {"prompt": "hi", "top_p": 0}),
    ("completions", {"prompt": "hi", "top_k": 0}),
    ("completions", {"prompt": "hi", "max_tokens": 0}),
    ("completions", {"prompt": "hi", "seed": 1.5}),
    ("completions", {"prompt": "hi", "stop": [""]}),
    ("completions", {"prompt": "hi", "n": 0}),
    ("completions", {"prompt": "hi", "logprobs": -1}),
    ("completions", {"prompt": "hi", "stop_token_ids": ["x"]}),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}),  # no logprobs
    ("completions", {"prompt": "hi", "presence_penalty": 0.5}),  # unsupported, so not silently ignored
    ("completions", {"prompt": "hi", "frequency_penalty": -1}),
    ("completions", {"prompt": "hi", "logit_bias": {"5": 10}}),
    ("completions", {"prompt": "hi", "echo": "yes"}),
    ("completions", {"prompt": "hi", "best_of": 2}),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]}),
    ("completions", {"prompt": "hello " * 2000}),  # longer than max_model_len
    ("completions", {"prompt": "hello " * 2000, "stream": True}),
]


@pytest.mark.parametrize("path,body", BAD_REQUESTS, ids=[f"{p}:{sorted(b)}" for p, b in BAD_REQUESTS])
def test_bad_request_gets_400_and_the_next_good_one_succeeds(server, path, body):
    response = httpx.post(f"{server}/v1/{path}", json=body, timeout=10)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"] and error["code"] is None
    good = httpx.post(f"{server}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10)
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 2


def test_the_server_log_has_a_line_per_error_and_with_access_log_one_per_request(server, server_log):
    bad = httpx.post(f"{server}/v1/completions", json={"prompt": "hi", "n": 0}, headers={"X-Request-Id": "log-1"},
                     timeout=10)
    good = httpx.post(f"{server}/v1/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=10)
    assert bad.status_code == 400 and bad.headers["x-request-id"] == "log-1" and good.status_code == 200
    lines = server_log.read_text().splitlines()
    assert [line.split(": ", 1)[1] for line in lines if " log-1 " in line] == [
        "log-1 POST /v1/completions 400 param=None: n must be an integer >= 1, got 0"]
    assert sum('"POST /v1/completions HTTP/1.1" 200' in line for line in lines) >= 1


def test_malformed_json_gets_400_and_openai_client_sees_bad_request(server, client, model_name):
    response = httpx.post(f"{server}/v1/completions", content=b"{not json", timeout=10,
                          headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model_name, prompt="hi", n=0)
    assert info.value.status_code == 400 and "n must be an integer >= 1" in info.value.message
    assert client.completions.create(model=model_name, prompt="hi", max_tokens=2).usage.completion_tokens == 2


def test_openai_fields_that_change_nothing_are_accepted(client, model_name, llm):
    expected = offline(llm, PROMPTS[4:5], **GREEDY)[0]["text"]
    response = client.completions.create(model=model_name, prompt=PROMPTS[4], user="someone", presence_penalty=0,
                                         frequency_penalty=0, logit_bias={}, logprobs=None, n=1, best_of=1,
                                         echo=False, **GREEDY)
    assert response.choices[0].text == expected
    messages = [{"role": "user", "content": "Name a colour."}]
    expected = offline(llm, [chat_prompt_ids(llm, messages)], **GREEDY)[0]["text"]
    response = client.chat.completions.create(model=model_name, messages=messages, user="someone", n=1,
                                              presence_penalty=0.0, frequency_penalty=0.0, logprobs=False, **GREEDY)
    assert response.choices[0].message.content == expected


def test_a_field_that_would_change_the_output_is_refused_by_name(server):
    response = httpx.post(f"{server}/v1/completions", json={"prompt": "hi", "presence_penalty": 1.5}, timeout=10)
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "presence_penalty"
    assert error["message"] == "presence_penalty: only 0.0 is supported: nanoengine has no repetition penalties"


def test_chat_content_may_be_a_list_of_text_parts(client, model_name, llm):
    parts = [{"type": "text", "text": "What is the capital"}, {"type": "text", "text": "of France?"}]
    joined = [{"role": "user", "content": "What is the capital\nof France?"}]  # parts joined by newlines, as vLLM
    expected = offline(llm, [chat_prompt_ids(llm, joined)], **GREEDY)[0]["text"]
    response = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": parts}],
                                              **GREEDY)
    assert response.choices[0].message.content == expected


def scrape(server) -> dict[str, float]:
    """``/metrics`` read by Prometheus's own parser: each sample's value by name, prefix and buckets left out."""
    response = httpx.get(f"{server}/metrics", timeout=5)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return {sample.name.removeprefix("nanoengine:"): sample.value
            for family in prometheus_parser.text_string_to_metric_families(response.text)
            for sample in family.samples if "le" not in sample.labels}


def test_metrics_parse_and_move_with_requests(server):
    wait_for_idle_stats(server)
    before = scrape(server)
    assert before["num_requests_running"] == before["num_requests_waiting"] == 0
    prompt = list(range(100, 140))  # 40 tokens: two full KV blocks, which the second request finds cached
    body = {"prompt": prompt, "max_tokens": 5, "ignore_eos": True, "temperature": 0}
    for _ in range(2):
        assert httpx.post(f"{server}/v1/completions", json=body, timeout=30).status_code == 200
    after = scrape(server)
    moved = {name: after[name] - before[name] for name in after}
    assert moved["prompt_tokens_total"] == 80 and moved["generation_tokens_total"] == 10
    assert moved["time_to_first_token_seconds_count"] == 2 and moved["inter_token_latency_seconds_count"] == 8
    assert moved["time_to_first_token_seconds_sum"] > 0 and moved["inter_token_latency_seconds_sum"] > 0
    assert moved["prefix_cache_hits_total"] >= 32 and moved["num_preemptions_total"] == 0


def test_every_engine_flag_is_an_llm_keyword_and_unset_ones_keep_the_defaults_but_chunked_prefill():
    from dataclasses import fields

    from nanoengine.config import Config
    from nanoengine.serve import ENGINE_OPTIONS, engine_options, make_parser
    keywords = {f.name for f in fields(Config) if f.init}
    assert {flag.removeprefix("--").replace("-", "_") for flag in ENGINE_OPTIONS} <= keywords
    parser = make_parser()
    assert engine_options(parser.parse_args([])) == {"enable_chunked_prefill": True}  # the server's own default
    args = parser.parse_args(["--max-num-batched-tokens", "4096", "--kvcache-block-size", "32", "--enforce-eager",
                              "--gpu-memory-utilization", "0.5", "--no-enable-prefix-caching", "--device", "cpu",
                              "--attention-backend", "torch"])
    config = Config.from_kwargs(None, engine_options(args))
    assert (config.max_num_batched_tokens, config.kvcache_block_size, config.enforce_eager,
            config.gpu_memory_utilization, config.enable_prefix_caching, config.device,
            config.attention_backend) == (4096, 32, True, 0.5, False, "cpu", "torch")


@pytest.mark.parametrize("module", ["fastapi", "uvicorn", "prometheus_client"])
def test_missing_server_dependency_is_one_line_naming_the_extra(module):
    code = (f"import runpy, sys; sys.modules[{module!r}] = None; "  # None: any import of it fails
            "runpy.run_module('nanoengine.serve', run_name='__main__')")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (f"nanoengine.serve needs {module}, which the 'serve' extra "
                                                      'installs: pip install -e ".[serve]"')


# -- failures, in a server run inside the test process so that faults can be injected into its engine --

@contextmanager
def in_process_server(model_path: str, **engine_options):
    """Yields the URL of a server on 127.0.0.1 and the ``LLMEngine`` behind it."""
    import uvicorn

    from nanoengine.async_engine import AsyncLLMEngine
    from nanoengine.serve import create_app
    async_engine = AsyncLLMEngine(model_path, dtype="float32", device="cpu", **engine_options)
    engine = async_engine.engine
    server = uvicorn.Server(uvicorn.Config(create_app(async_engine, "tiny"), log_level="warning"))
    # Bound and listening before the server starts: connections wait in the backlog, no polling for startup.
    sock = socket.create_server(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", engine
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


@pytest.fixture
def local_server(tiny_models):
    with in_process_server(tiny_models["llama"]) as (url, engine):
        yield url, engine


def test_async_engine_is_built_on_the_thread_that_steps_it(tiny_models, monkeypatch):
    """One thread does all the model's work, so the process holds one OpenMP pool, as offline."""
    from nanoengine.async_engine import AsyncLLMEngine
    from nanoengine.engine import LLMEngine
    threads = {"built": set(), "stepped": set()}
    build, step = LLMEngine.__init__, LLMEngine.step

    def recording_build(self, *args, **kwargs):
        threads["built"].add(threading.get_ident())
        build(self, *args, **kwargs)

    def recording_step(self):
        threads["stepped"].add(threading.get_ident())
        return step(self)
    monkeypatch.setattr(LLMEngine, "__init__", recording_build)
    monkeypatch.setattr(LLMEngine, "step", recording_step)
    engine = AsyncLLMEngine(tiny_models["llama"], dtype="float32", device="cpu")

    async def generate() -> list[int]:
        stream = await engine.add_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        return [token for output in [out async for out in stream] for token in output.token_ids]
    try:
        assert len(asyncio.run(generate())) == 3
    finally:
        engine.shutdown()
    assert len(threads["built"]) == 1 and threads["built"] == threads["stepped"]
    assert threading.get_ident() not in threads["built"]


def test_async_engine_with_a_bad_option_raises_value_error_in_the_caller(tiny_models):
    from nanoengine.async_engine import AsyncLLMEngine
    with pytest.raises(ValueError, match="max_num_seqs must be a positive integer"):
        AsyncLLMEngine(tiny_models["llama"], dtype="float32", device="cpu", max_num_seqs=0)


def sse_data(response: httpx.Response) -> Iterator[str]:
    """The data of each server-sent event, as it arrives."""
    return (line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: "))


def test_failed_step_fails_only_its_requests_with_an_error(local_server, tokenizer, monkeypatch):
    url, engine = local_server
    doomed = tokenizer.encode("a prompt whose steps fail")
    run, in_flight_at_faults = engine.model_runner.run, []

    def faulty_run(seqs, *args):
        if any(seq.token_ids[:seq.num_prompt_tokens] == doomed for seq in seqs):
            in_flight_at_faults.append(len(engine.requests))
            raise RuntimeError("injected fault")
        return run(seqs, *args)
    monkeypatch.setattr(engine.model_runner, "run", faulty_run)

    survivor = {"prompt": PROMPTS[0], "temperature": 0, "max_tokens": 48, "ignore_eos": True}
    with httpx.Client(base_url=url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json={**survivor, "stream": True}) as response:
            lines = sse_data(response)
            events = [next(lines)]  # the survivor is running: the doomed requests join it mid-flight
            plain = http.post("/v1/completions", json={"prompt": doomed, "max_tokens": 4})
            streamed = http.post("/v1/completions", json={"prompt": doomed, "max_tokens": 4, "stream": True})
            events += lines
        assert in_flight_at_faults == [2, 2]  # each fault hit a step while the survivor was in flight

        assert plain.status_code == 500
        assert plain.json()["error"]["type"] == "server_error" and "injected fault" in plain.json()["error"]["message"]
        assert streamed.status_code == 200
        *chunks, error, done = sse_data(streamed)
        assert not chunks and "injected fault" in json.loads(error)["error"]["message"] and done == "[DONE]"

        assert events[-1] == "[DONE]"
        chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
        alone = http.post("/v1/completions", json=survivor).json()["choices"][0]
        assert "".join(c["text"] for c in chunks) == alone["text"] and chunks[-1]["finish_reason"] == "length"

        monkeypatch.undo()
        assert http.post("/v1/completions", json={"prompt": doomed, "max_tokens": 4}).status_code == 200
        assert http.get("/stats").json()["kvcache_blocks_in_use"] == 0


def test_engine_thread_that_dies_fails_requests_at_once_and_health_says_503(local_server, monkeypatch):
    url, engine = local_server
    with httpx.Client(base_url=url, timeout=10) as http:  # the timeout bounds any hang
        body = {"prompt": PROMPTS[0], "max_tokens": 500, "ignore_eos": True, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as response:
            lines = sse_data(response)
            next(lines)

            def broken() -> bool:
                raise RuntimeError("injected loop fault")
            monkeypatch.setattr(engine, "has_unfinished_requests", broken)  # called by the loop, not by work
            *_, error, done = lines
        assert "injected loop fault" in json.loads(error)["error"]["message"] and done == "[DONE]"

        health = http.get("/health")
        assert health.status_code == 503 and "injected loop fault" in health.json()["error"]["message"]
        for stream in (False, True):
            response = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stream": stream})
            assert response.status_code == 503 and "engine thread died" in response.json()["error"]["message"]


def test_work_that_raises_on_the_engine_thread_leaves_it_serving(local_server, monkeypatch):
    url, engine = local_server
    abort_request, failed = engine.abort_request, threading.Event()

    def abort_that_raises(request_id: int) -> None:
        abort_request(request_id)
        failed.set()
        raise RuntimeError("injected abort fault")
    monkeypatch.setattr(engine, "abort_request", abort_that_raises)
    with httpx.Client(base_url=url, timeout=10) as http:
        body = {"prompt": PROMPTS[0], "max_tokens": 500, "ignore_eos": True, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as response:
            next(response.iter_lines())
        # Leaving the stream early aborts its request: the abort runs, then raises, on the engine thread.
        assert failed.wait(timeout=10)
        assert http.get("/health").status_code == 200
        assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
        assert http.get("/stats").json()["kvcache_blocks_in_use"] == 0


def test_non_streaming_client_that_disconnects_is_aborted(local_server):
    url, engine = local_server
    # A chat request with no max_tokens may run to the end of the context: only the abort can end it early.
    body = json.dumps({"messages": [{"role": "user", "content": "Go on forever"}], "ignore_eos": True}).encode()
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
        client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + 10
        while (stats := httpx.get(f"{url}/stats", timeout=5).json())["kvcache_blocks_in_use"] == 0:
            assert time.monotonic() < deadline, f"the request never started: {stats}"
            time.sleep(0.05)
    after = wait_for_idle_stats(url)
    assert 0 < after["generated_tokens"] < engine.config.max_model_len // 2


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_a_prompt_being_tokenized_does_not_hold_up_other_streams(local_server, monkeypatch, endpoint):
    url, engine = local_server
    # A completion's prompt is encoded; a chat's conversation is templated (and tokenized) in one call.
    name = "encode" if endpoint == "completions" else "apply_chat_template"
    tokenize, entered, release = getattr(engine.tokenizer, name), threading.Event(), threading.Event()
    tokens_at_entry, released_by_a_stream = [], []

    def slow_tokenize(prompt, *args, **kwargs):
        if "slow prompt" in str(prompt):  # held until the other stream is seen to move, or 30 s
            tokens_at_entry.append(engine.counters["generated_tokens"] - before)
            entered.set()
            released_by_a_stream.append(release.wait(timeout=30))
        return tokenize(prompt, *args, **kwargs)
    monkeypatch.setattr(engine.tokenizer, name, slow_tokenize)

    slow = {"prompt": "a slow prompt"} if endpoint == "completions" else {
        "messages": [{"role": "user", "content": "a slow prompt"}]}
    responses = []
    before = engine.counters["generated_tokens"]
    with httpx.Client(base_url=url, timeout=60) as http:
        body = {"prompt": PROMPTS[0], "max_tokens": 1000, "ignore_eos": True, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as response:
            lines = sse_data(response)
            next(lines)
            waiter = threading.Thread(target=lambda: responses.append(
                httpx.post(f"{url}/v1/{endpoint}", json={**slow, "max_tokens": 2}, timeout=60)))
            waiter.start()
            assert entered.wait(timeout=30)
            # A chunk carries at least one token, so more chunks than the tokens generated when the
            # slow prompt's tokenization began means chunks were sent while it was under way.
            chunks = 1
            while chunks <= tokens_at_entry[0] + 1:
                next(lines)
                chunks += 1
            release.set()
            waiter.join(timeout=60)
    assert released_by_a_stream == [True] and responses[0].status_code == 200


def test_metrics_gauges_show_running_and_waiting_requests(local_server, monkeypatch):
    url, engine = local_server
    run = engine.model_runner.run

    def slow_run(*args, **kwargs):  # the tiny model would finish before the scrape otherwise
        time.sleep(0.01)
        return run(*args, **kwargs)
    monkeypatch.setattr(engine.model_runner, "run", slow_run)
    monkeypatch.setattr(engine.scheduler, "max_num_seqs", 1)  # the second request must wait for the first
    body = {"prompt": PROMPTS[0], "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json=body) as first:
            lines = sse_data(first)  # kept: a generator dropped here would close the stream, aborting it
            next(lines)
            with http.stream("POST", "/v1/completions", json=body):  # queued once its headers are back
                during = scrape(url)
    assert during["num_requests_running"] == 1 and during["num_requests_waiting"] == 1
    assert 0 < during["kv_cache_usage_perc"] <= 1
