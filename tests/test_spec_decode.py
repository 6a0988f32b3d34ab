"""Speculative decoding: drafts verified in one target step, outputs as without them.

Greedy identity is checked against the same engine without speculation on the tiny float32
models, with an *oracle* proposer that knows the reference completions and guesses every third
token wrong (so runs are accepted, cut and rejected in every position), and with the n-gram and
draft-model proposers. Sampling is checked against the target distribution directly, on the
rejection sampler, with a chi-square bound.
"""

import contextlib
import json
import os

import pytest
import torch

from nanoengine import LLM, SamplingParams
from nanoengine.spec_rejection_sampler import RejectionSampler
from nanoengine.sampler import Sampler
from nanoengine.spec_decode import NgramProposer, SpeculativeConfig
from tests.conftest import TINY_ARCHS, OracleProposer, make_copying_model, make_tiny_model

# The chi-square distribution's 0.999 quantile by degrees of freedom (index 0: none).
CHI2_AT_0_001 = [0.0, 10.83, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32, 26.12, 27.88]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
# Prompts that share a 32-token prefix (prefix hits), with repeats for the n-gram proposer to find.
PREFIX = list(range(200, 232))
PROMPTS = [PREFIX + [7, 8, 9, 7, 8], PREFIX + list(range(300, 340)), [5, 6, 5, 6, 5, 6, 5], PREFIX + [11] * 9]


@contextlib.contextmanager
def oracle(spec: LLM, prompts: list[list[int]], reference: list[dict], proposer=OracleProposer):
    """``spec`` drafting from ``reference``'s completions for the duration."""
    proposer, spec.proposer = spec.proposer, proposer(prompts, [r["token_ids"] for r in reference])
    try:
        yield
    finally:
        spec.proposer = proposer


def spec_stats(llm: LLM) -> dict:
    return {k.removeprefix("spec_decode_"): v for k, v in llm.stats().items() if k.startswith("spec_decode_")}


@pytest.fixture(scope="module")
def engines(tiny_models):
    """Per architecture: a plain engine and one with speculation (n-gram, swapped for the oracle where asked)."""
    common = dict(dtype="float32", device="cpu", kvcache_block_size=16)
    return {arch: (LLM(tiny_models[arch], **common), LLM(tiny_models[arch], **common, speculative_config=NGRAM))
            for arch in TINY_ARCHS}


def test_speculative_config_is_checked():
    with pytest.raises(ValueError, match="unknown key"):
        SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3})
    with pytest.raises(ValueError, match="method must be one of"):
        SpeculativeConfig.from_dict({"method": "eagle", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="num_speculative_tokens must be a positive integer"):
        SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="needs \\['num_speculative_tokens'\\]"):
        SpeculativeConfig.from_dict({"method": "ngram"})
    with pytest.raises(ValueError, match="prompt_lookup_min=4 is more than prompt_lookup_max=2"):
        SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2,
                                     "prompt_lookup_min": 4})
    with pytest.raises(ValueError, match="model .* is needed"):
        SpeculativeConfig.from_dict({"method": "draft_model", "num_speculative_tokens": 2})
    config = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3})
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (3, 3)  # vLLM's defaults: each from the other
    assert config.disable_by_batch_size == 32
    with pytest.raises(ValueError, match="speculative_config must be a dict"):
        LLM(None, speculative_config="ngram")


def test_ngram_lookup_proposes_what_followed_the_latest_longest_match():
    proposer = NgramProposer(SpeculativeConfig("ngram", 3, prompt_lookup_max=3, prompt_lookup_min=1))
    # "1 2 3" occurs twice before the end; the later occurrence is followed by 7 8 9.
    assert proposer.lookup([1, 2, 3, 4, 5, 1, 2, 3, 7, 8, 9, 0, 1, 2, 3], 3) == [7, 8, 9]
    # The 3-gram "9 1 2" is nowhere else; the 2-gram "1 2" is, followed by 3 4.
    assert proposer.lookup([1, 2, 3, 4, 9, 1, 2], 2) == [3, 4]
    assert proposer.lookup([1, 2, 3, 4, 9, 1, 2], 9) == [3, 4, 9, 1, 2]  # what there is, up to k
    assert proposer.lookup([5, 6, 7, 8], 3) == []  # nothing repeats: nothing proposed
    # Token 256 is bytes 00 01 00 00: a byte-level match starting inside a token is not a match.
    assert proposer.lookup([1, 256, 0, 9, 256], 2) == [0, 9]
    # Bytes 00 00 00 01 | 00 00 00 00 | 01 00 00 00: token 1's bytes occur at byte 3, inside two tokens.
    assert proposer.lookup([0x01000000, 0, 1], 2) == []


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_greedy_outputs_are_identical_with_and_without_speculation(engines, arch):
    """The oracle's drafts, with stop conditions landing inside accepted runs: EOS (not ignored),
    stop strings cut from the reference text, max_tokens; outputs and finish reasons as without drafts."""
    plain, spec = engines[arch]
    reference = plain.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=23),
              SamplingParams(temperature=0, max_tokens=40, stop=[reference[2]["text"][30:34]]),
              SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[reference[3]["token_ids"][17]])]
    before = spec_stats(spec)
    with oracle(spec, PROMPTS, reference):
        ours = spec.generate(PROMPTS, params, use_tqdm=False)
    expected = plain.generate(PROMPTS, params, use_tqdm=False)
    for a, b in zip(ours, expected):
        assert (a["token_ids"], a["text"], a["finish_reason"]) == (b["token_ids"], b["text"], b["finish_reason"])
    after = spec_stats(spec)
    assert after["num_accepted_tokens"] - before["num_accepted_tokens"] > 40  # runs were accepted...
    assert after["num_draft_tokens"] - after["num_accepted_tokens"] > 10  # ...and cut by wrong guesses
    assert spec.stats()["kvcache_blocks_in_use"] == 0


def test_decode_counters_count_kept_tokens_and_sequences_not_verified_drafts(engines):
    """One sequence, drafts often refused: each decode step counts one sequence, and the decode
    tokens are the tokens it gave (the first came from the prefill), not the positions it verified."""
    plain, spec = engines["llama"]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    reference = plain.generate(PROMPTS[:1], params, use_tqdm=False)
    before = spec.stats()
    with oracle(spec, PROMPTS[:1], reference):
        spec.generate(PROMPTS[:1], params, use_tqdm=False)
    d = {k: v - before[k] for k, v in spec.stats().items()}
    assert d["spec_decode_num_draft_tokens"] > d["spec_decode_num_accepted_tokens"] > 0
    assert d["decode_seqs"] == d["decode_steps"] and d["decode_tokens"] == d["generated_tokens"] - 1 == 39


def test_bad_words_and_allowed_token_ids_judge_drafts_as_they_judge_samples(engines, tokenizer):
    """Drafts from the unconstrained completions: the banned and disallowed ones are rejected, and
    the outputs are those of plain decoding with the same parameters."""
    plain, spec = engines["llama"]
    reference = plain.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)
    word = tokenizer.decode(reference[0]["token_ids"][10:12])  # a word the first completion writes
    allowed = sorted(set(reference[1]["token_ids"][:20]) | {5, 6})
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, bad_words=[word]),
              SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, allowed_token_ids=allowed)]
    with oracle(spec, PROMPTS[:2], reference[:2]):
        ours = spec.generate(PROMPTS[:2], params, use_tqdm=False)
    expected = plain.generate(PROMPTS[:2], params, use_tqdm=False)
    assert [o["token_ids"] for o in ours] == [e["token_ids"] for e in expected]
    assert all(e["token_ids"] != r["token_ids"] for e, r in zip(expected, reference))  # each changed the output
    assert set(ours[1]["token_ids"]) <= set(allowed)


@pytest.mark.parametrize("options", [dict(enable_chunked_prefill=True, max_num_batched_tokens=32),
                                     dict(num_kvcache_blocks=10)], ids=["chunked", "preempting"])
def test_greedy_identity_holds_with_chunked_prefill_and_preemption(tiny_models, options):
    common = dict(dtype="float32", device="cpu", kvcache_block_size=16, max_model_len=160, **options)
    plain, spec = LLM(tiny_models["qwen3"], **common), LLM(tiny_models["qwen3"], **common, speculative_config=NGRAM)
    prompts = PROMPTS * 2
    reference = plain.generate(prompts, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True), use_tqdm=False)
    with oracle(spec, prompts, reference):
        ours = spec.generate(prompts, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True), use_tqdm=False)
    assert [r["token_ids"] for r in ours] == [r["token_ids"] for r in reference]
    stats = spec.stats()
    assert stats["spec_decode_num_accepted_tokens"] > 0 and stats["kvcache_blocks_in_use"] == 0
    if "num_kvcache_blocks" in options:
        assert stats["num_preemptions"] > 0


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_ngram_speculation_changes_nothing(engines, arch):
    """The n-gram proposer's own drafts (random weights hardly repeat themselves, so most are refused;
    whether any are proposed depends on the CPU kind's rounding: the next test makes sure of it)."""
    plain, spec = engines[arch]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    ours = spec.generate(PROMPTS, params, use_tqdm=False)
    assert [r["token_ids"] for r in ours] == [r["token_ids"] for r in plain.generate(PROMPTS, params, use_tqdm=False)]


def test_ngram_drafts_of_text_that_repeats_are_found_and_accepted(tokenizer, tmp_path):
    """A model that repeats its last token: the lookup finds its drafts at every step, whatever the CPU
    kind, and the target accepts them; the output is plain decoding's."""
    model = make_copying_model(str(tmp_path / "copying"), tokenizer)
    common = dict(dtype="float32", device="cpu", kvcache_block_size=16)
    plain, spec = LLM(model, **common), LLM(model, **common, speculative_config=NGRAM)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    ours = spec.generate(PROMPTS, params, use_tqdm=False)
    assert [r["token_ids"] for r in ours] == [r["token_ids"] for r in plain.generate(PROMPTS, params, use_tqdm=False)]
    stats = spec_stats(spec)
    assert stats["num_accepted_tokens"] > 32 and stats["num_drafts"] < 4 * 32


def test_random_token_prompts_give_the_ngram_proposer_nothing_to_propose():
    """bench.py's random workload: prompt ids uniform over the vocabulary, so no 2-gram repeats and
    every step stays a plain decode step (the graph's), at no cost but the lookup."""
    proposer = NgramProposer(SpeculativeConfig("ngram", 4, prompt_lookup_max=4, prompt_lookup_min=2))
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 49152, (256,), generator=generator).tolist() for _ in range(64)]
    assert all(proposer.lookup(prompt, 4) == [] for prompt in prompts)


def test_logprobs_and_seeded_samples_with_speculation(engines):
    """Logprobs are those of the emitted tokens, as without drafts; a seed gives the same samples again."""
    plain, spec = engines["qwen2"]
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=3)
    expected = plain.generate(PROMPTS, greedy, use_tqdm=False)
    with oracle(spec, PROMPTS, expected):
        ours = spec.generate(PROMPTS, greedy, use_tqdm=False)
        seeded = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=30, ignore_eos=True, seed=11, n=2)
        first, again = (spec.generate(PROMPTS, seeded, use_tqdm=False) for _ in range(2))
    for x, y in zip(ours, expected):
        x, y = x["outputs"][0], y["outputs"][0]
        assert x["token_ids"] == y["token_ids"] and x["cumulative_logprob"] == pytest.approx(y["cumulative_logprob"])
        for mine, theirs in zip(x["logprobs"], y["logprobs"], strict=True):
            assert mine.keys() == theirs.keys() and all(abs(mine[t] - theirs[t]) < 1e-4 for t in mine)
    assert [[s["token_ids"] for s in r["outputs"]] for r in first] == \
        [[s["token_ids"] for s in r["outputs"]] for r in again]


def test_draft_model_equal_to_the_target_has_every_greedy_draft_accepted(tiny_models, tmp_path, tokenizer):
    common = dict(dtype="float32", device="cpu", kvcache_block_size=16)
    plain = LLM(tiny_models["llama"], **common)
    reference = plain.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    other = make_tiny_model(os.fspath(tmp_path / "draft"), "llama", tokenizer, seed=1, num_hidden_layers=1)
    for draft, all_accepted in ((tiny_models["llama"], True), (other, False)):
        spec = LLM(tiny_models["llama"], **common, speculative_config={"method": "draft_model", "model": draft,
                                                                        "num_speculative_tokens": 3})
        ours = spec.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
        assert [r["token_ids"] for r in ours] == [r["token_ids"] for r in reference]
        stats = spec_stats(spec)
        assert stats["num_draft_tokens"] > 0
        assert (stats["num_accepted_tokens"] == stats["num_draft_tokens"]) == all_accepted
        assert spec.stats()["kvcache_blocks_in_use"] == 0 and not spec.proposer.shadows
        assert spec.proposer.block_manager.num_used_blocks == 0  # the draft's cache is given back too


def test_a_draft_model_that_is_missing_or_of_another_vocabulary_is_refused(tiny_models, tmp_path, tokenizer):
    with pytest.raises(ValueError, match="speculative_config.model: .*does not exist"):
        LLM(tiny_models["llama"], dtype="float32", speculative_config={"method": "draft_model", "num_speculative_tokens": 2,
                                                                       "model": os.fspath(tmp_path / "nowhere")})
    path = make_tiny_model(os.fspath(tmp_path / "draft"), "llama", tokenizer, vocab_size=len(tokenizer) + 64)
    with pytest.raises(ValueError, match="must share the target's tokenizer"):
        LLM(tiny_models["llama"], dtype="float32", speculative_config={"method": "draft_model", "model": path,
                                                                       "num_speculative_tokens": 2})


@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=0.7, top_k=5, top_p=0.8)])
def test_rejection_sampling_keeps_the_target_distribution(params):
    """Many samples of one step with a draft: the first token's frequencies and the second token's
    (where the first was the draft) against the target's probabilities, the chi-square statistic
    below its p = 0.001 quantile, and no token outside top-k/top-p ever emitted."""
    torch.manual_seed(0)
    vocab, draws = 10, 40_000
    row0, row1 = torch.randn(vocab) * 1.5, torch.randn(vocab) * 1.5
    draft = int(row0.argsort()[-2])  # a likely token, not the likeliest: accepted and refused often
    logits = torch.stack([row0, row1]).repeat(draws, 1)
    n = 2 * draws
    args = ([params["temperature"]] * n, [params.get("top_k", -1)] * n, [params.get("top_p", 1.0)] * n,
            [None] * n, list(range(n)))
    tokens, _ = RejectionSampler(Sampler())(logits, [[draft]] * draws, *args)
    sampler = Sampler()
    target = sampler.probs(torch.stack([row0, row1]), *[a[:2] for a in args[:3]])
    first = torch.bincount(torch.tensor([t[0] for t in tokens]), minlength=vocab).float()
    second = torch.bincount(torch.tensor([t[1] for t in tokens if len(t) > 1 and t[0] == draft]),
                            minlength=vocab).float()
    for counts, p in ((first, target[0]), (second, target[1])):
        assert counts[p == 0].sum() == 0
        expected = p[p > 0] * counts.sum()
        chi2 = ((counts[p > 0] - expected) ** 2 / expected).sum().item()
        assert chi2 < CHI2_AT_0_001[len(expected) - 1], (chi2, counts, expected)
    assert second.sum() > draws * 0.05  # the draft was accepted often enough to test what follows it


def test_server_takes_a_speculative_config_and_counts_drafts_in_its_metrics(engines, tiny_models):
    """``serve --speculative-config JSON``: a draft model equal to the target, so every draft is accepted."""
    pytest.importorskip("aiohttp")  # bench_serving's client, which starts the server
    prometheus_parser = pytest.importorskip("prometheus_client.parser")
    import httpx

    from bench_serving import nanoengine_server
    spec = json.dumps({"method": "draft_model", "model": tiny_models["llama"], "num_speculative_tokens": 3})
    body = {"prompt": PROMPTS[1], "max_tokens": 24, "ignore_eos": True, "temperature": 0}
    with nanoengine_server(["--model", tiny_models["llama"], "--dtype", "float32", "--device", "cpu",
                            "--speculative-config", spec]) as url:
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as events:
            chunks = [json.loads(line.removeprefix("data: ")) for line in events.iter_lines()
                      if line.startswith("data: {")]
        metrics = {sample.name.removeprefix("nanoengine:"): sample.value for family in
                   prometheus_parser.text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=5).text)
                   for sample in family.samples}
    plain, _ = engines["llama"]
    expected = plain.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                              use_tqdm=False)[0]
    assert response["choices"][0]["text"] == expected["text"]
    # Streamed, a step's chunk carries every token it accepted: fewer chunks than tokens, the same text.
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected["text"] and len(chunks) < 24
    assert metrics["spec_decode_num_accepted_tokens_total"] == metrics["spec_decode_num_draft_tokens_total"] >= 12
    assert metrics["spec_decode_num_drafts_total"] > 0


def test_no_drafts_once_disable_by_batch_size_sequences_run(tiny_models):
    llm = LLM(tiny_models["llama"], dtype="float32", device="cpu", speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 2})
    greedy = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (8, 16, 30)]
    reference = llm.generate(PROMPTS[:3], greedy, use_tqdm=False)
    batches = []

    class Recording(OracleProposer):
        def propose(self, seqs, max_drafts):
            if seqs:
                batches.append(len(llm.scheduler.running))
            return super().propose(seqs, max_drafts)
    llm.proposer = Recording(PROMPTS[:3], [r["token_ids"] for r in reference])
    ours = llm.generate(PROMPTS[:3], greedy, use_tqdm=False)
    assert [r["token_ids"] for r in ours] == [r["token_ids"] for r in reference]
    assert batches and max(batches) == 1  # drafts only for the last request, alone


def test_structured_requests_get_no_drafts_beside_requests_that_do(engines):
    """A grammar's sequence is never given drafts (its mask would have to follow each one); the
    requests beside it in the batch still verify theirs, and nothing changes in either's output."""
    pytest.importorskip("llguidance")
    from nanoengine import StructuredOutputsParams
    plain, spec = engines["llama"]
    choice = StructuredOutputsParams(choice=["yes", "no", "it depends"])
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=30, structured_outputs=choice)]
    prompts = [PROMPTS[0], "Is the sea blue?"]
    reference = plain.generate(prompts, params, use_tqdm=False)
    constrained = []

    class Recording(OracleProposer):
        def propose(self, seqs, max_drafts):
            constrained.extend(seq.grammar is not None for seq in seqs)
            return super().propose(seqs, max_drafts)
    with oracle(spec, PROMPTS[:1], reference[:1], Recording):
        before = spec_stats(spec)
        ours = spec.generate(prompts, params, use_tqdm=False)
    assert [r["token_ids"] for r in ours] == [r["token_ids"] for r in reference]
    assert ours[1]["text"] in choice.choice and constrained and not any(constrained)
    assert spec_stats(spec)["num_accepted_tokens"] > before["num_accepted_tokens"]
