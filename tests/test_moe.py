"""Mixtures of experts (moe.py; Qwen3-MoE, Mixtral, OLMoE) against HF transformers.

The layer first, against HF's own sparse block of each family on the same weights: odd token
counts, experts left without tokens, and top-k ties; quantized experts against their weights read
back. Then whole tiny models (conftest.py's ``make_tiny_model``, vocabulary 512) through the
engine's paths, as test_model_families.py runs the dense families: teacher-forced logits through
the paged cache (C++ kernels and learner mode), and HF's greedy tokens through chunked prefill with
preemption, prefix-cache hits with several samples of a prompt, and speculative verification.
Routing is spread by construction: a decode step of 3 sequences picks at most 3 * top_k experts
(fewer than each family has: some get no tokens), a prefill of 49 tokens at least
49 * top_k / num_experts for one of them. Last, tensor parallelism: two ranks split each expert and
compute what one does.
"""

import functools
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, MixtralConfig, OlmoeConfig, Qwen3MoeConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from nanoengine import LLM, SamplingParams, quantization
from nanoengine.model import check_tensor_parallel_size
from nanoengine.model_families import MoESpec, family_spec
from nanoengine.moe import FusedMoE, permute, route
from nanoengine.sequence import Sequence
from nanoengine.spec_decode import SpeculativeConfig
from tests.conftest import OracleProposer, make_tiny_model
from tests.test_model_families import KERNELS, assert_teacher_forced_logits_match_hf, random_prompts
from tests.test_model_vs_hf import assert_greedy_matches_hf
from tests.test_tensor_parallel import GREEDY, NUM_DECODE_STEPS, OPTIONS, PROMPT_LENS, shared_prefix_prompts, \
    teacher_forced_logits

FAMILIES = ("qwen3_moe", "mixtral", "olmoe")
VOCAB = 512


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory, tokenizer) -> dict[str, str]:
    root = tmp_path_factory.mktemp("moe")
    return {family: make_tiny_model(os.fspath(root / family), family, tokenizer, vocab_size=VOCAB)
            for family in FAMILIES}


@functools.cache
def hf_model(path: str):
    """HF's model with its experts run by its per-expert loop ("eager"): its default, "grouped_mm",
    took 0.2 s a call here, on CPU."""
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, experts_implementation="eager").eval()


def assert_generation_matches_hf(llm: LLM, path: str, prompts: list[list[int]], params: SamplingParams) -> list:
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        for sample in out.get("outputs") or [out]:
            assert len(sample["token_ids"]) == params.max_tokens
            assert_greedy_matches_hf(hf_model(path), prompt, sample["token_ids"])
    return outputs


# -- the layer ---------------------------------------------------------------------------------------

HF_BLOCKS = {  # family -> (HF's sparse block, its config, our MoESpec of it)
    "qwen3_moe": (Qwen3MoeSparseMoeBlock, Qwen3MoeConfig(hidden_size=64, moe_intermediate_size=32, num_experts=8,
                                                         num_experts_per_tok=2, norm_topk_prob=True),
                  MoESpec(8, 2, 32, renormalize=True)),
    "mixtral": (MixtralSparseMoeBlock, MixtralConfig(hidden_size=64, intermediate_size=32, num_local_experts=8,
                                                     num_experts_per_tok=2), MoESpec(8, 2, 32, renormalize=True)),
    "olmoe": (OlmoeSparseMoeBlock, OlmoeConfig(hidden_size=64, intermediate_size=32, num_experts=8,
                                               num_experts_per_tok=2, norm_topk_prob=False),
              MoESpec(8, 2, 32, renormalize=False)),
}


def hf_block_and_ours(family: str):
    block_class, config, spec = HF_BLOCKS[family]
    torch.manual_seed(0)
    hf = block_class(config).eval()
    with torch.no_grad():
        for p in hf.parameters():  # HF's experts are made with torch.empty
            p.normal_(0, 0.25)
        # Experts 2, 3 and 5 score every token alike: a token along their router row picks two of the
        # three, chosen as torch.topk breaks the tie.
        hf.gate.weight[[3, 5]] = hf.gate.weight[2].clone()
    ours = FusedMoE(64, spec, tp=None)
    ours.load_state_dict({"gate.weight": hf.gate.weight, "experts.gate_up_proj": hf.experts.gate_up_proj,
                          "experts.down_proj": hf.experts.down_proj})
    return hf, ours


@pytest.mark.parametrize("family", FAMILIES)
@torch.inference_mode()
def test_moe_layer_matches_hfs_sparse_block_with_empty_experts_and_ties(family):
    hf, ours = hf_block_and_ours(family)
    gen = torch.Generator().manual_seed(1)
    for num_tokens in (1, 7, 33):
        x = torch.randn(num_tokens, 64, generator=gen)
        x[-1] = hf.gate.weight[2] * 4
        _, hf_weights, hf_ids = hf.gate(x)
        weights, ids = route(ours.gate(x), ours.top_k, ours.renormalize)
        assert torch.equal(ids, hf_ids)  # the same experts, in the same order, ties included
        assert set(ids[-1].tolist()) < {2, 3, 5}  # two of the three tied experts
        torch.testing.assert_close(weights, hf_weights.float(), atol=1e-6, rtol=0)
        torch.testing.assert_close(ours(x), hf(x[None])[0], atol=1e-5, rtol=1e-5)
        counts = permute(ids, 8)[1]
        assert sum(counts) == 2 * num_tokens and (num_tokens > 1 or counts.count(0) == 6)


# -- whole models against HF ---------------------------------------------------------------------------

@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("family", FAMILIES)
@torch.inference_mode()
def test_teacher_forced_moe_logits_match_hf_through_paged_cache(family, kernels, moe_models):
    """A prefill of 49 tokens in three prompts, then decode steps of three sequences; on the C++ kernels
    and in learner mode (torch everywhere)."""
    llm = LLM(moe_models[family], dtype="float32", device="cpu", kvcache_block_size=4,
              enable_prefix_caching=False, **KERNELS[kernels])
    model = llm.model_runner.model
    sparse = [type(layer.mlp) is FusedMoE for layer in model.model.layers]
    assert sparse == ([True, False, True] if family == "qwen3_moe" else [True] * 3)
    assert_teacher_forced_logits_match_hf(llm, hf_model(moe_models[family]), (5, 17, 27), 8)


@pytest.mark.parametrize("family", FAMILIES)
@torch.inference_mode()
def test_moe_chunked_prefill_with_preemption_matches_hf(family, moe_models):
    """Chunks of at most 6 tokens beside decode rows, in ten blocks of 4 that cannot hold the three
    growing sequences: some are preempted and recomputed."""
    llm = LLM(moe_models[family], dtype="float32", device="cpu", kvcache_block_size=4, num_kvcache_blocks=10,
              max_model_len=40, enable_chunked_prefill=True, max_num_batched_tokens=6, max_num_seqs=4)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    assert_generation_matches_hf(llm, moe_models[family], random_prompts(VOCAB, (9, 12, 14), seed=1), params)
    assert llm.stats()["num_preemptions"] > 0


@pytest.mark.parametrize("family", FAMILIES)
@torch.inference_mode()
def test_moe_prefix_cache_hits_and_several_samples_match_hf(family, moe_models):
    """The second round's prompts extend the first's (their first blocks come from the cache), and
    each is sampled 3 times, greedily: the samples share its blocks and each continues as HF."""
    llm = LLM(moe_models[family], dtype="float32", device="cpu", kvcache_block_size=4)
    prompts = random_prompts(VOCAB, (13, 21), seed=2)
    assert_generation_matches_hf(llm, moe_models[family], prompts, SamplingParams(temperature=0, max_tokens=8,
                                                                                  ignore_eos=True))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, n=3)
    outputs = assert_generation_matches_hf(llm, moe_models[family], [p + p[:5] for p in prompts], params)
    assert all(len(out["outputs"]) == 3 for out in outputs)
    assert llm.stats()["prefix_cache_hit_tokens"] >= 12 + 20


@pytest.mark.parametrize("fmt", quantization.FORMATS)
@torch.inference_mode()
def test_quantized_experts_compute_what_their_dequantized_weights_do(fmt):
    """Each expert's weights quantized (int8, int4) and multiplied by the quantized kernel, against the
    same layer in float32 over the weights read back: the same routing (the router is never
    quantized), and outputs apart only by the kernel's rounding of x (about 1%; a weight read in the
    wrong layout, or another expert's, would point elsewhere: cosine about 0)."""
    _, ours = hf_block_and_ours("mixtral")
    reference = FusedMoE(64, HF_BLOCKS["mixtral"][2], tp=None)
    reference.load_state_dict(ours.state_dict())
    ours.experts.quantize(fmt)
    assert ours.experts.gate_up_proj is None and ours.experts.quantized
    for leaf in ("gate_up_proj", "down_proj"):
        qweight, scales = getattr(ours.experts, f"{leaf}_qweight"), getattr(ours.experts, f"{leaf}_scales")
        getattr(reference.experts, leaf).copy_(torch.stack(
            [quantization.dequantize_packed(qweight[e], None if scales is None else scales[e]) for e in range(8)]))
    x = torch.randn(33, 64, generator=torch.Generator().manual_seed(2))
    expected, got = reference(x), ours(x)
    assert torch.nn.functional.cosine_similarity(got, expected, dim=-1).min() > 0.999
    assert (got - expected).abs().max() < 0.05 * expected.abs().max()


@pytest.mark.parametrize("family", FAMILIES)
@torch.inference_mode()
def test_int4_moe_models_run_close_to_hf(family, moe_models):
    """Whole models with int4 experts (and linear layers) through the engine: logits close to HF's
    float32 ones in direction at most positions, held to test_model_families.py's int4 bound. Not at
    all: a token whose router scores two experts nearly alike may pick the other one once the weights
    are rounded, which changes its logits. (int8 is held tighter, layer by layer, above.)"""
    llm = LLM(moe_models[family], dtype="float32", device="cpu", kvcache_block_size=4, quantization="int4")
    model, runner = llm.model_runner.model, llm.model_runner
    experts = model.model.layers[0].mlp.experts
    assert experts.quantized and experts.gate_up_proj is None
    (prompt,) = random_prompts(VOCAB, (20,), seed=5)
    seq = Sequence(prompt, SamplingParams(), 4)
    llm.block_manager.allocate(seq)
    seq.num_scheduled_tokens = seq.num_tokens
    logits = model.compute_logits(model(*runner.prepare_prefill([seq])))
    expected = hf_model(moe_models[family])(torch.tensor([prompt])).logits[0]
    centred = [x - x.mean(dim=-1, keepdim=True) for x in (logits, expected)]
    assert torch.nn.functional.cosine_similarity(*centred, dim=-1).median() > 0.5


# -- tensor parallelism ----------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe"])
def test_two_ranks_each_holding_half_of_every_expert_compute_what_one_does(family, moe_models):
    """Qwen3-MoE (sparse and dense layers) and OLMoE (its q/k norms over heads the ranks share out,
    its one kv head on both) over two ranks: teacher-forced logits within 1e-4 of size 1's (float32;
    only the order of the partial sums differs), then the same greedy tokens through preemption and
    prefix-cache hits."""
    path = moe_models[family]
    single, tp = LLM(path, **OPTIONS), LLM(path, tensor_parallel_size=2, **OPTIONS)
    try:
        gen = torch.Generator().manual_seed(0)
        full = [torch.randint(0, VOCAB, (n + NUM_DECODE_STEPS,), generator=gen).tolist() for n in PROMPT_LENS]
        for expected, got in zip(teacher_forced_logits(single, full), teacher_forced_logits(tp, full)):
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
        prompts = shared_prefix_prompts(VOCAB)
        expected = [out["token_ids"] for out in single.generate(prompts, GREEDY, use_tqdm=False)]
        assert [out["token_ids"] for out in tp.generate(prompts, GREEDY, use_tqdm=False)] == expected
        assert tp.stats()["num_preemptions"] > 0 and tp.stats()["prefix_cache_hit_tokens"] > 0
    finally:
        tp.workers.shutdown()


@torch.inference_mode()
def test_moe_speculative_verification_steps_give_hfs_greedy_tokens(moe_models):
    """Drafts (the oracle's: right two times in three) verified several tokens a step, through the
    experts in one batch, and rejected positions taken back: HF's greedy tokens still."""
    path = moe_models["mixtral"]
    llm = LLM(path, dtype="float32", device="cpu", kvcache_block_size=4)
    prompts, params = random_prompts(VOCAB, (9, 17), seed=7), SamplingParams(temperature=0, max_tokens=12,
                                                                               ignore_eos=True)
    expected = [out["token_ids"] for out in assert_generation_matches_hf(llm, path, prompts, params)]
    llm.config.speculative_config, llm.proposer = SpeculativeConfig("ngram", 3), OracleProposer(prompts, expected)
    assert_generation_matches_hf(llm, path, prompts, params)
    assert llm.stats()["spec_decode_num_accepted_tokens"] > 0


# -- configs --------------------------------------------------------------------------------------------

def test_qwen3_moe_layers_are_sparse_as_mlp_only_layers_and_decoder_sparse_step_say():
    config = Qwen3MoeConfig(num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3])
    assert [layer.sparse for layer in family_spec(config).layers] == [False, True, False, False, False, True]


@pytest.mark.parametrize("config, message", [
    (OlmoeConfig(clip_qkv=8.0), "config.clip_qkv=8.0"),
    (MixtralConfig(hidden_act="gelu"), "hidden_act 'gelu'"),
    (Qwen3MoeConfig(num_experts=4, num_experts_per_tok=8), "num_experts_per_tok=8"),
])
def test_an_unsupported_moe_config_is_a_value_error_naming_the_field(config, message):
    with pytest.raises(ValueError, match=message):
        family_spec(config)


def test_an_expert_split_must_be_even():
    config = Qwen3MoeConfig(num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                            moe_intermediate_size=30)
    with pytest.raises(ValueError, match="does not divide the model's experts' intermediate_size 30"):
        check_tensor_parallel_size(config, 4)


