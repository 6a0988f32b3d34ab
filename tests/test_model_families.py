"""The families of model_families.py (Mistral, Gemma 2, Gemma 3, Phi-3) against HF transformers.

Tiny random models (conftest.py's ``make_tiny_model``) with a sliding window of 8 tokens and
cache blocks of 4 or 8, so that every prompt reaches past the window and the keys left of it
still sit in the cache, where attention must skip them. Organised by mechanism: teacher-forced
logits through the paged cache, then greedy generation through each path that reads the cache
another way (chunked prefill across the window's edge, prefix-cache hits, preemption and
recomputation, several samples of one prompt) on the C++ kernels; the logits in learner mode (torch)
too, whose attention the generation tests' paths share.
"""

import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config

from nanoengine import LLM, SamplingParams
from nanoengine.model_families import family_spec
from nanoengine.sequence import Sequence
from tests.conftest import make_tiny_model
from tests.test_model_vs_hf import assert_greedy_matches_hf

FAMILIES = ("mistral", "gemma2", "gemma3", "phi3")
KERNELS = {"cpp": {}, "learner_mode": {"learner_mode": True}}
WINDOW = 8


@pytest.fixture(scope="module")
def family_models(tmp_path_factory, tokenizer) -> dict[str, str]:
    root = tmp_path_factory.mktemp("families")
    return {family: make_tiny_model(os.fspath(root / family), family, tokenizer) for family in FAMILIES}


def hf_model(path: str):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def random_prompts(vocab_size: int, lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in lengths]


def assert_teacher_forced_logits_match_hf(llm: LLM, hf, prompt_lens: tuple[int, ...], steps: int) -> None:
    """Random prompts of ``prompt_lens`` in one prefill step, then ``steps`` decode steps each fed the
    next token of the same random text: every position's logits through the paged cache equal HF's
    over the whole text."""
    runner, model = llm.model_runner, llm.model_runner.model
    full = random_prompts(llm.vocab_size, tuple(n + steps for n in prompt_lens), seed=0)
    expected = [hf(torch.tensor([ids])).logits[0] for ids in full]
    seqs = [Sequence(ids[:n], SamplingParams(), llm.block_manager.block_size) for ids, n in zip(full, prompt_lens)]
    for seq in seqs:
        llm.block_manager.allocate(seq)
        seq.num_scheduled_tokens = seq.num_tokens
    logits = model.compute_logits(model(*runner.prepare_prefill(seqs)))
    start = 0
    for i, n in enumerate(prompt_lens):
        torch.testing.assert_close(logits[start:start + n], expected[i][:n], atol=1e-4, rtol=0)
        start += n
    for step in range(steps):
        for seq, ids, n in zip(seqs, full, prompt_lens):
            seq.append_token(ids[n + step])
            llm.block_manager.may_append(seq)
        logits = model.compute_logits(model(*runner.prepare_decode(seqs)))
        for i, n in enumerate(prompt_lens):
            torch.testing.assert_close(logits[i], expected[i][n + step], atol=1e-4, rtol=0)


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("family", FAMILIES)
@torch.inference_mode()
def test_teacher_forced_logits_match_hf_through_paged_cache(family, kernels, family_models):
    """A prefill of prompts within, at and past the window, then decode steps that slide it on."""
    llm = LLM(family_models[family], dtype="float32", device="cpu", kvcache_block_size=4,
              enable_prefix_caching=False, **KERNELS[kernels])
    model = llm.model_runner.model
    windows = [layer.self_attn.attn.window_size for layer in model.model.layers]
    assert (WINDOW - 1, 0) in windows  # the sliding layers are sliding: every layer in Mistral's config
    assert_teacher_forced_logits_match_hf(llm, hf_model(family_models[family]), (5, 8, 23), 12)


GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def assert_generation_matches_hf(llm: LLM, path: str, prompts: list[list[int]], params=GREEDY) -> list[dict]:
    outputs = llm.generate(prompts, params, use_tqdm=False)
    hf = hf_model(path)
    for prompt, out in zip(prompts, outputs):
        for sample in out.get("outputs") or [out]:
            assert len(sample["token_ids"]) == params.max_tokens
            assert_greedy_matches_hf(hf, prompt, sample["token_ids"])
    return outputs


@pytest.mark.parametrize("kernels", ["cpp"])
@pytest.mark.parametrize("family", FAMILIES)
@torch.inference_mode()
def test_chunked_prefill_across_the_window_edge_matches_hf(family, kernels, family_models):
    """Chunks of at most 6 tokens: a chunk's queries see the window's keys from earlier chunks,
    read back from the cache, and decode rows share steps with prompt chunks."""
    llm = LLM(family_models[family], dtype="float32", device="cpu", kvcache_block_size=4,
              enable_chunked_prefill=True, max_num_batched_tokens=6, max_num_seqs=4, **KERNELS[kernels])
    assert_generation_matches_hf(llm, family_models[family], random_prompts(llm.vocab_size, (3, 17, 30), seed=1))


@pytest.mark.parametrize("kernels", ["cpp"])
@pytest.mark.parametrize("family", FAMILIES)
@torch.inference_mode()
def test_prefix_cache_hits_match_hf(family, kernels, family_models):
    """The second round's prompts extend the first's: their first blocks come from the prefix cache,
    more than a window's worth, and only the rest is computed."""
    llm = LLM(family_models[family], dtype="float32", device="cpu", kvcache_block_size=4, **KERNELS[kernels])
    prompts = random_prompts(llm.vocab_size, (21, 30), seed=2)
    assert_generation_matches_hf(llm, family_models[family], prompts)
    longer = [prompt + prompt[:5] for prompt in prompts]
    assert_generation_matches_hf(llm, family_models[family], longer)
    assert llm.stats()["prefix_cache_hit_tokens"] >= 2 * 20


@pytest.mark.parametrize("kernels", ["cpp"])
@pytest.mark.parametrize("family", FAMILIES)
@torch.inference_mode()
def test_preempted_sequences_recompute_to_hfs_tokens(family, kernels, family_models):
    """Ten blocks of 4 cannot hold four growing sequences, even where the window releases blocks (all
    of Mistral's and Phi-3's layers slide): some are preempted and recomputed."""
    llm = LLM(family_models[family], dtype="float32", device="cpu", kvcache_block_size=4, num_kvcache_blocks=10,
              max_model_len=40, **KERNELS[kernels])
    assert_generation_matches_hf(llm, family_models[family], random_prompts(llm.vocab_size, (5, 9, 3, 6), seed=3))
    assert llm.stats()["num_preemptions"] > 0


@pytest.mark.parametrize("kernels", ["cpp"])
@pytest.mark.parametrize("family", FAMILIES)
@torch.inference_mode()
def test_several_samples_of_a_prompt_each_match_hf(family, kernels, family_models):
    """n=3 greedy samples share the prompt's blocks (forked, not recomputed); each continues as HF."""
    llm = LLM(family_models[family], dtype="float32", device="cpu", kvcache_block_size=4, **KERNELS[kernels])
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, n=3)
    outputs = assert_generation_matches_hf(llm, family_models[family],
                                           random_prompts(llm.vocab_size, (19,), seed=4), params)
    assert len(outputs[0]["outputs"]) == 3


@torch.inference_mode()
def test_triton_attention_gives_hfs_greedy_tokens_with_window_and_softcap(family_models):
    """Gemma 2's sliding layers and soft caps on the Triton kernels (interpreted on CPU), chunked."""
    triton = pytest.importorskip("triton")
    if not triton.knobs.runtime.interpret:
        pytest.skip("Triton compiles in this session (a GPU machine): the cuda tests run these kernels")
    llm = LLM(family_models["gemma2"], dtype="float32", attention_backend="triton", enforce_eager=True,
              max_model_len=128, enable_chunked_prefill=True, max_num_batched_tokens=16)
    assert_generation_matches_hf(llm, family_models["gemma2"], random_prompts(llm.vocab_size, (5, 30), seed=6))


# -- what is refused ---------------------------------------------------------------------------------

def test_an_unsupported_architecture_is_a_value_error_naming_it():
    config = GPT2Config(architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="model type 'gpt2' \\(GPT2LMHeadModel\\) is not supported"):
        family_spec(config)


@pytest.mark.parametrize("family, overrides, message", [
    ("gemma2", {"hidden_activation": "gelu"}, "hidden_activation 'gelu'"),
    ("gemma2", {"layer_types": ["chunked_attention", "full_attention"]}, "layer type 'chunked_attention'"),
    ("gemma3", {"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                    "full_attention": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}}},
     "rope type 'yarn' \\(config.rope_parameters\\['full_attention'\\]\\)"),
])
def test_an_unsupported_config_field_is_a_value_error_naming_it(tokenizer, tmp_path, family, overrides, message):
    path = make_tiny_model(os.fspath(tmp_path / family), family, tokenizer)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config | overrides, f)
    with pytest.raises(ValueError, match=message):
        LLM(path, dtype="float32", device="cpu")


@torch.inference_mode()
def test_longrope_turns_positions_past_the_original_context_by_hfs_long_factors(family_models):
    """Within the original context (64 here) a position turns as HF's short factors turn it; past
    it, as HF's long factors do (HF then turns the whole sequence so; see layers.longrope_angles)."""
    from transformers import AutoConfig
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding
    config = AutoConfig.from_pretrained(family_models["phi3"])
    llm = LLM(family_models["phi3"], dtype="float32", device="cpu", max_model_len=128)
    rotary = llm.model_runner.model.model.layers[0].self_attn.rotary_emb
    assert rotary.rotary_dim == 8  # half of each 16-wide head
    ours = rotary.cos_sin_cache[:100]
    x = torch.zeros(1, dtype=torch.float32)
    short_cos, short_sin = Phi3RotaryEmbedding(config)(x, torch.arange(64)[None])
    long_cos, long_sin = Phi3RotaryEmbedding(config)(x, torch.arange(100)[None])
    torch.testing.assert_close(ours[:64, :8], short_cos[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(ours[:64, 12:], short_sin[0, :, 4:], atol=1e-6, rtol=0)
    torch.testing.assert_close(ours[64:, :8], long_cos[0, 64:], atol=1e-6, rtol=0)
    torch.testing.assert_close(ours[64:, 12:], long_sin[0, 64:, 4:], atol=1e-6, rtol=0)
    assert not torch.allclose(short_cos[0, 1:], long_cos[0, 1:64], atol=1e-3)  # the factors differ


@pytest.mark.parametrize("quantization, similarity", [("int8", 0.99), ("int4", 0.5)])
@pytest.mark.parametrize("family", FAMILIES)
@torch.inference_mode()
def test_quantized_weights_run_each_family_close_to_hf(family, quantization, similarity, family_models):
    """Weight-only int8 and int4 (quantization.py) round the weights, so each position's logits are held
    close to HF's float32 ones in direction (cosine, about their mean) rather than equal. These random
    weights (initializer_range 0.25) magnify int4's rounding: measured, 0.65-0.99 by family; a weight read
    in the wrong layout scores about 0."""
    llm = LLM(family_models[family], dtype="float32", device="cpu", kvcache_block_size=4,
              quantization=quantization)
    model, runner = llm.model_runner.model, llm.model_runner
    (prompt,) = random_prompts(llm.vocab_size, (20,), seed=5)
    seq = Sequence(prompt, SamplingParams(), 4)
    llm.block_manager.allocate(seq)
    seq.num_scheduled_tokens = seq.num_tokens
    logits = model.compute_logits(model(*runner.prepare_prefill([seq])))
    expected = hf_model(family_models[family])(torch.tensor([prompt])).logits[0]
    centred = [x - x.mean(dim=-1, keepdim=True) for x in (logits, expected)]
    assert torch.nn.functional.cosine_similarity(*centred, dim=-1).min() > similarity


@pytest.mark.parametrize("name", ["gemma-3-1b", "gemma-2-2b"])
def test_bench_runs_dummy_weights_of_each_familys_config(tmp_path, name):
    """The real models' layer shapes (tests/data, cut to 2 layers and an 8k vocabulary to stay fast: Gemma's
    256k-token embedding alone is 2.4 GB in float32), no weights, no tokenizer. (Mistral 7B's shapes are a
    Llama's, with a window: the tiny Mistral's tests run that path.)"""
    import re
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "tests", "data", name, "config.json")) as f:
        config = json.load(f)
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2, "vocab_size": 8192}))
    cmd = [sys.executable, "bench.py", "--model", str(tmp_path), "--load-format", "dummy", "--num-seqs", "2",
           "--min-input-len", "8", "--max-input-len", "16", "--min-output-len", "4", "--max-output-len", "8",
           "--dtype", "bfloat16", "--device", "cpu"]
    result = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert re.search(r"Throughput: \d+\.\d{2}tok/s$", result.stdout.strip())
