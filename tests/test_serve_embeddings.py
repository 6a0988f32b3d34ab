"""``/v1/embeddings``, run for real: a server started with ``--runner pooling`` on a tiny model,
driven by the official openai client's ``embeddings.create`` (and httpx for raw HTTP). Its vectors
are the offline ``LLM.embed``'s on the same weights, as floats and as base64; a server that
generates answers embeddings with a 400, as a pooling server answers completions."""

import base64

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("aiohttp")  # the server starts through bench_serving.py, an aiohttp client

from nanoengine import LLM  # noqa: E402
from nanoengine.serve_embeddings import EmbeddingRequest  # noqa: E402
from tests.test_serve import in_process_server, openai_error, subprocess_server  # noqa: E402

TEXTS = ["The sea is wide.", "Mountains rise above the clouds, and snow lies on them all year.", "Hi"]
MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("serve_embeddings") / "server.log"
    args = ["--model", tiny_models["qwen3"], "--dtype", "float32", "--device", "cpu", "--served-model-name",
            "tiny-embed",
            "--runner", "pooling", "--pooler-config", '{"pooling_type": "MEAN"}', "--max-model-len", str(MAX_MODEL_LEN),
            "--max-num-batched-tokens", "16"]  # chunked prefill (the server's default), in chunks of 16 tokens
    with subprocess_server(args, log_path) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(tiny_models["qwen3"], dtype="float32", runner="pooling", pooler_config={"pooling_type": "MEAN"},
               max_model_len=MAX_MODEL_LEN)


def offline(llm, prompts, **params) -> np.ndarray:
    return np.array([out.embedding for out in llm.embed(prompts, use_tqdm=False, **params)], dtype=np.float32)


def test_every_field_of_openais_embeddings_api_is_declared():
    from openai.types import embedding_create_params
    assert set(embedding_create_params.EmbeddingCreateParams.__annotations__) <= EmbeddingRequest.model_fields.keys()


def test_sdk_embeddings_as_floats_and_as_base64_equal_offline(client, llm):
    expected = offline(llm, TEXTS)
    as_floats = client.embeddings.create(model="tiny-embed", input=TEXTS, encoding_format="float")
    assert as_floats.object == "list" and as_floats.model == "tiny-embed"
    assert [d.index for d in as_floats.data] == [0, 1, 2] and {d.object for d in as_floats.data} == {"embedding"}
    np.testing.assert_allclose(np.array([d.embedding for d in as_floats.data]), expected, atol=1e-5, rtol=0)
    num_tokens = sum(len(llm.tokenize(text)) for text in TEXTS)
    assert (as_floats.usage.prompt_tokens, as_floats.usage.total_tokens) == (num_tokens, num_tokens)
    # Unless told otherwise the SDK asks for base64 and decodes it: the same floats (from another
    # step, so up to the summation order of the batch it shares).
    decoded = client.embeddings.create(model="tiny-embed", input=TEXTS)
    np.testing.assert_allclose(np.array([d.embedding for d in decoded.data]), expected, atol=1e-5, rtol=0)
    raw = client.embeddings.create(model="tiny-embed", input=TEXTS[0], encoding_format="base64")
    vector = np.frombuffer(base64.b64decode(raw.data[0].embedding), dtype="<f4")  # OpenAI's: little-endian float32
    np.testing.assert_allclose(vector, expected[0], atol=1e-5, rtol=0)


def test_every_input_form_gives_the_offline_vectors(client, llm):
    token_ids = [llm.tokenize(text) for text in TEXTS]
    expected = offline(llm, token_ids)
    for given, rows in [(TEXTS[1], [1]), (token_ids[0], [0]), (token_ids, [0, 1, 2]), (TEXTS, [0, 1, 2])]:
        response = client.embeddings.create(model="tiny-embed", input=given, encoding_format="float")
        np.testing.assert_allclose(np.array([d.embedding for d in response.data]), expected[rows], atol=1e-5, rtol=0)


def test_a_long_input_is_refused_naming_input_or_cut_by_truncate_prompt_tokens(server, client, llm):
    long = list(range(100, 100 + MAX_MODEL_LEN + 6))
    error = openai_error(httpx.post(f"{server}/v1/embeddings", json={"input": [[5, 6], long]}), 400)
    assert error["param"] == "input"
    assert error["message"] == f"input[1]: prompt has {len(long)} tokens, more than max_model_len={MAX_MODEL_LEN}"
    cut = client.embeddings.create(model="tiny-embed", input=long, encoding_format="float",
                                   extra_body={"truncate_prompt_tokens": 20})
    assert cut.usage.prompt_tokens == 20
    np.testing.assert_allclose(np.array(cut.data[0].embedding), offline(llm, [long[-20:]])[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("body, param, message", [
    ({"input": "Hi", "dimensions": 16}, "dimensions", "dimensions=16: this model is not Matryoshka-trained"),
    ({"input": []}, "input", "input must hold 1 to 2048 inputs, got 0"),
    ({"input": ["Hi"] * 2049}, "input", "input must hold 1 to 2048 inputs, got 2049"),
    ({"input": ""}, "input", "input: prompt is empty"),
    ({"input": [[1, 2], [10**9]]}, "input", "input[1]: prompt token ids [1000000000] are outside"),
    ({"input": {"text": "Hi"}}, "input", "input: must be a string, a list of strings"),
    ({"input": "Hi", "encoding_format": "int8"}, "encoding_format", "encoding_format: Input should be 'float'"),
    ({"input": "Hi", "truncate_prompt_tokens": MAX_MODEL_LEN + 1}, "truncate_prompt_tokens",
     "truncate_prompt_tokens must be -1 (max_model_len) or an integer in [1, max_model_len=64]"),
])
def test_a_bad_embeddings_request_is_a_400_naming_the_field(server, body, param, message):
    error = openai_error(httpx.post(f"{server}/v1/embeddings", json=body), 400)
    assert error["param"] == param and error["message"].startswith(message), error


def test_a_pooling_server_refuses_completions_saying_why(server, client):
    with pytest.raises(openai.BadRequestError, match="runner is 'pooling': it embeds prompts"):
        client.completions.create(model="tiny-embed", prompt="Hello", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="runner is 'pooling'"):
        client.chat.completions.create(model="tiny-embed", messages=[{"role": "user", "content": "Hello"}])
    with pytest.raises(openai.BadRequestError, match="runner is 'pooling'"):
        client.responses.create(model="tiny-embed", input="Hello")
    assert httpx.get(f"{server}/stats").json()["kvcache_blocks_in_use"] == 0


def test_a_generating_server_answers_embeddings_with_how_to_start_one_that_embeds(tiny_models):
    with in_process_server(tiny_models["llama"], max_model_len=MAX_MODEL_LEN) as (url, _):
        error = openai_error(httpx.post(f"{url}/v1/embeddings", json={"input": "Hi"}), 400)
    assert "start it with --runner pooling" in error["message"]

