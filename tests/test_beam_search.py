"""Beam search against HF transformers' ``generate(num_beams=W, do_sample=False, early_stopping=False)``
on the same float32 weights: the same beams, in the same order."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from nanoengine import LLM, BeamSearchParams
from tests.conftest import make_tiny_model

PROMPTS = [list(range(100, 120)), list(range(300, 307))]
MAX_TOKENS = 8


@torch.inference_mode()
def hf_beams(path: str, prompt: list[int], width: int, length_penalty: float, eos: list[int]) -> tuple[list, list]:
    """HF's ``width`` beams (cut after their EOS) and their scores, best first."""
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = hf.generate(torch.tensor([prompt]), num_beams=width, num_return_sequences=width, do_sample=False,
                      early_stopping=False, length_penalty=length_penalty, max_new_tokens=MAX_TOKENS,
                      eos_token_id=eos, pad_token_id=eos[0], return_dict_in_generate=True, output_scores=True)
    beams = []
    for seq in out.sequences[:, len(prompt):].tolist():
        end = next((i + 1 for i, t in enumerate(seq) if t in eos), len(seq))
        beams.append(seq[:end])
    return beams, out.sequences_scores.tolist()


@pytest.fixture(scope="module")
def eos_on_the_way(tmp_path_factory, tokenizer) -> tuple[str, int]:
    """A tiny model whose EOS is a token its greedy completion of the first prompt reaches at step 3,
    so that beams finish early and the early-stopping rule is exercised."""
    path = make_tiny_model(str(tmp_path_factory.mktemp("beam") / "llama"), "llama", tokenizer, seed=1)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    greedy = hf.generate(torch.tensor([PROMPTS[0]]), do_sample=False, max_new_tokens=3, eos_token_id=None)
    eos = greedy[0, -1].item()
    return make_tiny_model(path, "llama", tokenizer, seed=1, eos_token_id=eos), eos


@pytest.mark.parametrize("length_penalty", [1.0, 0.0, 2.0])
@pytest.mark.parametrize("width", [2, 4])
@pytest.mark.parametrize("model", ["default", "eos_on_the_way"])
def test_beam_search_equals_hf(model, width, length_penalty, tiny_models, eos_on_the_way, tokenizer):
    if model == "default":
        path, eos = tiny_models["llama"], []
    else:
        path, eos = eos_on_the_way[0], [eos_on_the_way[1]]
    llm = LLM(path, dtype="float32", device="cpu", kvcache_block_size=16, num_kvcache_blocks=128)
    eos = sorted(llm.scheduler.eos_token_ids | set(eos))  # what the engine stops at: HF is given the same
    results = llm.beam_search(PROMPTS, BeamSearchParams(width, MAX_TOKENS, length_penalty=length_penalty))
    for prompt, result in zip(PROMPTS, results):
        beams, scores = hf_beams(path, prompt, width, length_penalty, eos)
        ours = result["sequences"]
        assert len(ours) == width and ours[0]["token_ids"] == beams[0]
        assert [b["token_ids"] for b in ours] == beams
        ours_scores = [b["cumulative_logprob"] / len(b["token_ids"]) ** length_penalty for b in ours]
        assert ours_scores == sorted(ours_scores, reverse=True) and ours_scores == pytest.approx(scores, abs=1e-3)
        for b in ours:  # the EOS that ended a beam is left out of its text, as a sample's stop token is
            shown = b["token_ids"][:-1] if b["token_ids"][-1] in eos else b["token_ids"]
            assert b["text"] == tokenizer.decode(shown, skip_special_tokens=True)
            # vLLM's names: its beams' tokens begin with the prompt's
            assert b.tokens == prompt + b.token_ids and b.cum_logprob == b.cumulative_logprob
    if model == "eos_on_the_way" and length_penalty == 0:  # scored by their sums, short beams win
        assert any(len(b["token_ids"]) < MAX_TOKENS for r in results for b in r["sequences"])
    assert llm.stats()["kvcache_blocks_in_use"] == 0


def test_include_stop_str_in_output_keeps_the_eos_that_ended_a_beam(eos_on_the_way, tokenizer):
    path, eos = eos_on_the_way
    llm = LLM(path, dtype="float32", device="cpu", kvcache_block_size=16, num_kvcache_blocks=128)
    params = dict(beam_width=2, max_tokens=MAX_TOKENS, length_penalty=0.0)
    left_out, kept = (llm.beam_search(PROMPTS[:1], BeamSearchParams(**params, include_stop_str_in_output=include))[0]
                      for include in (False, True))
    ended = [(a, b) for a, b in zip(left_out["sequences"], kept["sequences"]) if a["token_ids"][-1] == eos]
    assert ended and all(a["token_ids"] == b["token_ids"] for a, b in ended)
    assert all(b["text"] == a["text"] + tokenizer.decode([eos]) != a["text"] for a, b in ended)
    with pytest.raises(ValueError, match="temperature must be 0"):  # vLLM's field: the default only
        BeamSearchParams(**params, temperature=0.5)
    assert BeamSearchParams(**params, temperature=0).temperature == 0


def test_beams_share_the_prompts_blocks_through_the_prefix_cache(tiny_models):
    llm = LLM(tiny_models["llama"], dtype="float32", device="cpu", kvcache_block_size=16, num_kvcache_blocks=128)
    prompt = list(range(500, 548))  # three full blocks
    llm.beam_search([prompt], BeamSearchParams(beam_width=4, max_tokens=4))
    stats = llm.stats()
    # Every beam of every step after the first reads the prompt's full blocks back from the cache.
    assert stats["prefix_cache_hit_tokens"] >= 3 * 4 * (16 * 2)
    assert stats["prefill_tokens"] < 4 * 4 * len(prompt) // 2
