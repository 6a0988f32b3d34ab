"""Embeddings offline (runner="pooling", pooler.py): ``LLM.embed``'s vectors against HF transformers'
hidden states (after the final norm) pooled the same way, on tiny random Llama and Qwen3 checkpoints;
the pooling a sentence-transformers checkpoint names; Matryoshka ``dimensions``; and the engine's
mechanism: prompts batched into one step, chunked, and served from the prefix cache give the
vectors that one prompt at a time gives."""

import json
import os
import shutil
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from nanoengine import LLM, PoolingParams, SamplingParams
from nanoengine.config import Config
from nanoengine.pooler import Pooler, PoolerConfig, load_pooler_config
from tests.conftest import make_tiny_model

SMALL = dict(dtype="float32", max_model_len=128, max_num_seqs=8)
SHARED = "You are a helpful assistant who answers questions about the weather in great detail. "
# Mixed lengths: one token, a few, more than one step's budget in the chunked engine below, and
# several that share a long prefix (full KV blocks the prefix cache can serve).
PROMPTS = ["Hi", "The sea is wide.", SHARED * 3 + "Is it raining?", SHARED + "Will it snow tomorrow?",
           SHARED + "How warm is it?", "Mountains"]


@pytest.fixture(scope="module")
def hf_models():
    """HF's model for each checkpoint path, loaded once."""
    from transformers import AutoModelForCausalLM
    cache = {}

    def load(path: str):
        if path not in cache:
            cache[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        return cache[path]
    return load


def hf_pooled(model, token_ids: list[int], pooling_type: str, normalize: bool, dimensions: int | None = None):
    with torch.no_grad():
        hidden = model.model(torch.tensor([token_ids])).last_hidden_state[0]  # after the final norm
    vector = {"LAST": hidden[-1], "MEAN": hidden.mean(0), "CLS": hidden[0]}[pooling_type][:dimensions]
    return F.normalize(vector, dim=-1) if normalize else vector


def vectors(outputs) -> torch.Tensor:
    return torch.tensor([out.embedding for out in outputs])


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("pooler_config", [None, {"pooling_type": "MEAN"}, {"pooling_type": "CLS", "normalize": False}])
def test_embed_equals_hf_hidden_states_pooled_the_same_way(tiny_models, hf_models, arch, pooler_config):
    llm = LLM(tiny_models[arch], runner="pooling", pooler_config=pooler_config, **SMALL)
    outputs = llm.embed(PROMPTS, use_tqdm=False)
    pooling_type = (pooler_config or {}).get("pooling_type", "LAST")
    normalize = (pooler_config or {}).get("normalize", True)
    for prompt, out in zip(PROMPTS, outputs):
        assert out.prompt_token_ids == llm.tokenize(prompt)
        assert out.outputs.embedding == out.embedding  # vLLM's spelling too
        expected = hf_pooled(hf_models(tiny_models[arch]), out.prompt_token_ids, pooling_type, normalize)
        torch.testing.assert_close(torch.tensor(out.embedding), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN", "CLS"])
def test_batched_chunked_and_prefix_cached_prompts_give_the_vectors_of_one_at_a_time(tiny_models, pooling_type):
    path, pooler_config = tiny_models["qwen3"], {"pooling_type": pooling_type}
    alone = LLM(path, runner="pooling", pooler_config=pooler_config, enable_prefix_caching=False, **SMALL)
    expected = torch.cat([vectors(alone.embed([prompt], use_tqdm=False)) for prompt in PROMPTS])
    # A budget of 32 tokens a step: the short prompts share steps, the long one is computed in chunks.
    llm = LLM(path, runner="pooling", pooler_config=pooler_config, enable_chunked_prefill=True,
              max_num_batched_tokens=32, kvcache_block_size=16, **SMALL)
    lengths = [len(llm.tokenize(prompt)) for prompt in PROMPTS]
    assert max(lengths) > 32 and min(lengths) == 1
    first = vectors(llm.embed(PROMPTS, use_tqdm=False))
    steps = llm.stats()["prefill_steps"]
    assert steps < len(PROMPTS)  # several prompts a step
    again = vectors(llm.embed(PROMPTS, use_tqdm=False))
    torch.testing.assert_close(first, expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(again, expected, atol=1e-4, rtol=0)
    stats = llm.stats()
    assert stats["kvcache_blocks_in_use"] == 0 and stats["generated_tokens"] == 0 and stats["decode_steps"] == 0
    if pooling_type == "LAST":  # the last position is always computed: the rest may come from the cache
        assert stats["prefix_cache_hit_tokens"] >= sum(lengths) - 16 * len(PROMPTS)
    else:  # MEAN and CLS need every position's hidden state: nothing is read back
        assert stats["prefix_cache_hit_tokens"] == 0 and not llm.config.enable_prefix_caching


def sentence_transformers_copy(model: str, path: str, mode: str | None, normalize: bool) -> str:
    """A copy of ``model`` with a sentence-transformers config: a Transformer, a Pooling module
    with ``mode`` set (in its 1_Pooling directory), and a Normalize module if ``normalize``."""
    shutil.copytree(model, path)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    with open(os.path.join(path, "modules.json"), "w") as file:
        json.dump(modules, file)
    os.makedirs(os.path.join(path, "1_Pooling"))
    flags = {f"pooling_mode_{m}": m == mode for m in ("cls_token", "mean_tokens", "max_tokens",
                                                      "mean_sqrt_len_tokens", "weightedmean_tokens", "lasttoken")}
    with open(os.path.join(path, "1_Pooling", "config.json"), "w") as file:
        json.dump({"word_embedding_dimension": 64, **flags, "include_prompt": True}, file)
    return path


def test_a_sentence_transformers_checkpoint_names_its_pooling(tiny_models, hf_models, tmp_path):
    path = sentence_transformers_copy(tiny_models["llama"], os.fspath(tmp_path / "st"), "mean_tokens", normalize=False)
    llm = LLM(path, runner="pooling", **SMALL)
    assert llm.config.pooler_config == PoolerConfig("MEAN", False)
    for out in llm.embed(PROMPTS[:2], use_tqdm=False):
        expected = hf_pooled(hf_models(tiny_models["llama"]), out.prompt_token_ids, "MEAN", normalize=False)
        torch.testing.assert_close(torch.tensor(out.embedding), expected, atol=1e-4, rtol=0)


def test_pooler_config_is_the_users_over_the_models_over_last_normalized(tiny_models, tmp_path):
    # Qwen3-Embedding's layout: last-token pooling, then Normalize.
    qwen3_embedding = sentence_transformers_copy(tiny_models["qwen3"], os.fspath(tmp_path / "q"), "lasttoken", True)
    assert load_pooler_config(qwen3_embedding, None) == PoolerConfig("LAST", True)
    assert load_pooler_config(qwen3_embedding, PoolerConfig(normalize=False)) == PoolerConfig("LAST", False)
    assert load_pooler_config(tiny_models["qwen3"], None) == PoolerConfig("LAST", True)  # no modules.json
    assert load_pooler_config(tiny_models["qwen3"], PoolerConfig("CLS")) == PoolerConfig("CLS", True)
    max_pooling = sentence_transformers_copy(tiny_models["qwen3"], os.fspath(tmp_path / "max"), "max_tokens", True)
    with pytest.raises(ValueError, match=r"pooling_mode_max_tokens.*pass pooler_config"):
        load_pooler_config(max_pooling, None)


def test_an_embedding_models_bare_decoder_checkpoint_loads_for_pooling(tiny_models, hf_models, tokenizer, tmp_path):
    """Qwen3-Embedding's layout: the decoder's tensors named without ``model.``, and no LM head."""
    from safetensors import safe_open
    from transformers import AutoModel
    path = os.fspath(tmp_path / "bare")
    AutoModel.from_pretrained(tiny_models["qwen3"], dtype=torch.float32).save_pretrained(path)
    tokenizer.save_pretrained(path)
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as file:
        names = set(file.keys())
    assert "embed_tokens.weight" in names and not any(name.startswith(("model.", "lm_head")) for name in names)
    llm = LLM(path, runner="pooling", **SMALL)
    out = llm.embed(PROMPTS[2], use_tqdm=False)[0]
    expected = hf_pooled(hf_models(tiny_models["qwen3"]), out.prompt_token_ids, "LAST", normalize=True)
    torch.testing.assert_close(torch.tensor(out.embedding), expected, atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match=r"lacks tensors \['lm_head.weight'\]"):  # generating needs the head
        LLM(path, **SMALL)


def test_dimensions_keep_a_matryoshka_models_first_dimensions_then_normalize(tokenizer, hf_models, tmp_path):
    path = make_tiny_model(os.fspath(tmp_path / "mrl"), "qwen3", tokenizer, is_matryoshka=True)
    llm = LLM(path, runner="pooling", **SMALL)
    out = llm.embed(PROMPTS[1], pooling_params=PoolingParams(dimensions=16), use_tqdm=False)[0]
    expected = hf_pooled(hf_models(path), out.prompt_token_ids, "LAST", normalize=True, dimensions=16)
    torch.testing.assert_close(torch.tensor(out.embedding), expected, atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="dimensions=65 is more than the model's 64"):
        llm.embed(PROMPTS[1], pooling_params=PoolingParams(dimensions=65))


def test_dimensions_are_refused_unless_the_model_is_matryoshka_trained():
    config = PoolerConfig("LAST", True)
    plain = Pooler(config, SimpleNamespace(hidden_size=64))
    with pytest.raises(ValueError, match="dimensions=16: this model is not Matryoshka-trained"):
        plain.check(PoolingParams(dimensions=16))
    listed = Pooler(config, SimpleNamespace(hidden_size=64, matryoshka_dimensions=[16, 32]))
    listed.check(PoolingParams(dimensions=32))
    with pytest.raises(ValueError, match=r"dimensions=24 is not one of the model's matryoshka_dimensions \[16, 32\]"):
        listed.check(PoolingParams(dimensions=24))
    with pytest.raises(ValueError, match="dimensions must be None or a positive integer"):
        PoolingParams(dimensions=0)


def test_a_long_prompt_is_cut_by_truncate_prompt_tokens_or_refused(tiny_models):
    llm = LLM(tiny_models["qwen3"], runner="pooling", dtype="float32", max_model_len=32, max_num_seqs=4)
    long = list(range(100, 150))
    with pytest.raises(ValueError, match="prompt has 50 tokens, more than max_model_len=32"):
        llm.embed([long], use_tqdm=False)
    cut = llm.embed([long], truncate_prompt_tokens=20, use_tqdm=False)[0]
    assert cut.prompt_token_ids == long[-20:]
    assert cut.embedding == llm.embed([long[-20:]], use_tqdm=False)[0].embedding
    by_params = llm.embed([long], pooling_params=PoolingParams(truncate_prompt_tokens=-1), use_tqdm=False)[0]
    assert by_params.prompt_token_ids == long[-32:]


def test_a_pooling_engine_refuses_to_generate_and_a_generating_one_to_embed(tiny_models):
    pooling = LLM(tiny_models["llama"], runner="pooling", **SMALL)
    with pytest.raises(ValueError, match="runner is 'pooling': it embeds prompts"):
        pooling.generate(["Hello"], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="runner is 'pooling'"):
        pooling.chat([{"role": "user", "content": "Hello"}], use_tqdm=False)
    generating = LLM(tiny_models["llama"], **SMALL)
    with pytest.raises(ValueError, match=r"embedding needs a pooling runner: LLM\(model, runner='pooling'\)"):
        generating.embed(["Hello"], use_tqdm=False)
    assert not pooling.has_unfinished_requests() and not generating.has_unfinished_requests()


@pytest.mark.parametrize("options, message", [
    (dict(runner="embed"), "runner must be 'generate' or 'pooling', got 'embed'"),
    (dict(pooler_config={"pooling_type": "MEAN"}), "pooler_config is for runner='pooling'"),
    (dict(runner="pooling", pooler_config={"pooling_type": "MAX"}), "pooler_config's pooling_type must be one of"),
    (dict(runner="pooling", pooler_config={"pooling": "MEAN"}), r"pooler_config has unknown key\(s\) \['pooling'\]"),
    (dict(runner="pooling", pooler_config={"normalize": 1}), "pooler_config's normalize must be true or false"),
    (dict(runner="pooling", pooler_config="MEAN"), "pooler_config must be a dict"),
    (dict(runner="pooling", speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
     "speculative_config drafts tokens, and runner='pooling' generates none"),
])
def test_runner_and_pooler_config_are_checked_naming_the_field(options, message):
    with pytest.raises(ValueError, match=message):
        Config(device="cpu", **options)
