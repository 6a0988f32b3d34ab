"""The engine's numbers against HF transformers on the same weights (the correctness oracle)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from nanoengine import LLM, SamplingParams
from nanoengine.rotary_embedding import RotaryEmbedding
from nanoengine.sequence import Sequence
from tests.conftest import TINY_ARCHS, make_tiny_model

PROMPT_LENS = (5, 23, 40)  # with 16-token blocks: within one block, across two, across three
NUM_DECODE_STEPS = 20


def hf_model(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", TINY_ARCHS)
@torch.inference_mode()
def test_teacher_forced_logits_match_hf_through_paged_cache(arch, dtype, tiny_models):
    """A mixed-length prefill batch, then step-by-step decode through 16-token blocks.

    In float32 the logits match HF's within 1e-4. bf16 (the CPU default: packed weights, the
    C++ kernels) rounds differently from HF's bf16, so it is held to HF's own accuracy: no
    further from HF's float32 logits than twice HF's bf16 run is.
    """
    llm = LLM(tiny_models[arch], dtype=dtype, kvcache_block_size=16, enable_prefix_caching=False)
    runner, model = llm.model_runner, llm.model_runner.model
    gen = torch.Generator().manual_seed(0)
    full = [torch.randint(0, llm.vocab_size, (n + NUM_DECODE_STEPS,), generator=gen).tolist() for n in PROMPT_LENS]
    hf = hf_model(tiny_models[arch])
    expected = [hf(torch.tensor([ids])).logits[0] for ids in full]
    atol = 1e-4
    if dtype == "bfloat16":
        hf_bf16 = hf.to(torch.bfloat16)
        atol = 2 * max((hf_bf16(torch.tensor([ids])).logits[0].float() - e).abs().max().item()
                       for ids, e in zip(full, expected))

    seqs = [Sequence(ids[:n], SamplingParams(), 16) for ids, n in zip(full, PROMPT_LENS)]
    for seq in seqs:
        llm.block_manager.allocate(seq)
        seq.num_scheduled_tokens = seq.num_tokens  # the whole prompt in one step
    input_ids, positions, ctx = runner.prepare_prefill(seqs)
    logits = model.compute_logits(model(input_ids, positions, ctx))
    for i, n in enumerate(PROMPT_LENS):
        start = int(ctx.cu_seqlens_q[i])
        torch.testing.assert_close(logits[start:start + n].float(), expected[i][:n], atol=atol, rtol=0)

    for step in range(NUM_DECODE_STEPS):
        for seq, ids, n in zip(seqs, full, PROMPT_LENS):
            seq.append_token(ids[n + step])  # teacher forcing: feed HF's sequence, not our samples
            llm.block_manager.may_append(seq)
        input_ids, positions, ctx = runner.prepare_decode(seqs)
        logits = model.compute_logits(model(input_ids, positions, ctx))
        for i, n in enumerate(PROMPT_LENS):
            torch.testing.assert_close(logits[i].float(), expected[i][n + step], atol=atol, rtol=0)
    assert max(len(seq.block_table) for seq in seqs) == 4  # 60 tokens span four blocks


def assert_greedy_matches_hf(hf, prompt_ids: list[int], ours: list[int]):
    """Our greedy tokens equal HF's, except after a step where HF's own top-2 logits tie.

    Scoring prompt + our tokens in one HF forward gives HF's greedy choice at every step of our
    continuation: as long as the tokens agree, that is exactly HF's own greedy generation.
    """
    ids = torch.tensor([prompt_ids + ours])
    logits = hf(ids).logits[0, len(prompt_ids) - 1:-1]
    for t, token in enumerate(ours):
        top2 = logits[t].topk(2)
        if token != int(top2.indices[0]):
            assert top2.values[0] - top2.values[1] < 1e-3, f"diverged from HF's greedy token at step {t}"
            assert token == int(top2.indices[1]), f"step {t}: {token} is not one of HF's tied top-2"
            return  # after a tie the two continuations legitimately differ


@pytest.mark.parametrize("arch", TINY_ARCHS)
@torch.inference_mode()
def test_greedy_generate_matches_hf(arch, tiny_models):
    llm = LLM(tiny_models[arch], dtype="float32", kvcache_block_size=16)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, llm.vocab_size, (n,), generator=gen).tolist() for n in (3, 17, 31, 50)]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    hf = hf_model(tiny_models[arch])
    for prompt, out in zip(prompts, outputs):
        assert len(out["token_ids"]) == 24 and out["finish_reason"] == "length"
        assert_greedy_matches_hf(hf, prompt, out["token_ids"])


# original_max_position_embeddings is small so that the scaling reaches the tiny head's frequencies:
# with head_dim 16 one pair is kept, one blended and six slowed by the factor.
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": 500000.0}


@torch.inference_mode()
def test_llama3_rope_scaling_greedy_matches_hf(tokenizer, tmp_path):
    path = make_tiny_model(str(tmp_path / "llama3"), "llama", tokenizer, rope_parameters=LLAMA3_ROPE)
    llm = LLM(path, dtype="float32", device="cpu", kvcache_block_size=16)
    rotary = llm.model_runner.model.model.layers[0].self_attn.rotary_emb
    plain = RotaryEmbedding(16, rotary.cos_sin_cache.shape[0], LLAMA3_ROPE["rope_theta"])
    assert not torch.allclose(rotary.cos_sin_cache[:100], plain.cos_sin_cache[:100], atol=1e-2)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, llm.vocab_size, (n,), generator=gen).tolist() for n in (9, 40, 70)]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    hf = hf_model(path)
    for prompt, out in zip(prompts, outputs):
        assert len(out["token_ids"]) == 24
        assert_greedy_matches_hf(hf, prompt, out["token_ids"])


@pytest.mark.parametrize("rope_type", ["yarn", "dynamic"])  # "linear" runs: Gemma 3's global layers
def test_unsupported_rope_type_raises_naming_it(tokenizer, tmp_path, rope_type):
    rope = {"rope_type": rope_type, "factor": 4.0, "rope_theta": 10000.0}
    path = make_tiny_model(str(tmp_path / rope_type), "llama", tokenizer, rope_parameters=rope)
    with pytest.raises(ValueError, match=f"rope type '{rope_type}'"):
        LLM(path, dtype="float32", device="cpu")


@torch.inference_mode()
def test_default_smollm2_greedy_matches_hf(tokenizer):
    from nanoengine.loader import resolve_model_path
    path = resolve_model_path(None)
    llm = LLM(None, dtype="float32")
    messages = ["What is the capital of France?", "Write a haiku about the sea.", "Count from one to five."]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": m}], tokenize=False,
                                             add_generation_prompt=True) for m in messages]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    directory, name = path.rsplit("/", 1)
    hf = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()
    for prompt, out in zip(prompts, outputs):
        assert_greedy_matches_hf(hf, tokenizer.encode(prompt), out["token_ids"])
    assert "Paris" in outputs[0]["text"]
