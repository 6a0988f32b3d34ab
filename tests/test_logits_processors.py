"""Logit bias, min_tokens, presence/frequency/repetition penalties and min-p, against HF's logits
processors and OpenAI's formula: on a batch of logits, then token for token in greedy decoding on
a tiny model (HF's forward and processors as the oracle), with n samples, after a preemption."""

import pytest
import torch
from transformers import (MinNewTokensLengthLogitsProcessor, MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                          SequenceBiasLogitsProcessor)

from nanoengine import LLM, SamplingParams
from nanoengine.logits_processors import apply_logits_processors, build_logits_processors, restrict
from nanoengine.sampler import Sampler
from tests.test_sequence_groups import hf, llm  # noqa: F401  (fixtures: the tiny llama, ours and HF's)

EOS = 2


def openai_penalties(presence: float, frequency: float, prompt_len: int):
    """OpenAI's definition, over the generated tokens only: logit -= frequency * count + presence * (count > 0)."""
    def process(input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        counts = torch.zeros_like(scores)
        completion = input_ids[:, prompt_len:]
        counts.scatter_add_(1, completion, torch.ones_like(completion, dtype=scores.dtype))
        return scores - (frequency * counts + presence * (counts > 0))
    return process


def processed(logits: torch.Tensor, rows: list[tuple[SamplingParams, list[int], list[int]]]) -> torch.Tensor:
    """Our processing of ``logits``, one row per (params, prompt, completion)."""
    states = []
    for params, prompt, completion in rows:
        counts = {}
        for t in completion:
            counts[t] = counts.get(t, 0) + 1
        states.append((params, prompt + completion, len(prompt), counts if params.penalizes else None, []))
    return apply_logits_processors(logits, build_logits_processors(states, {EOS}, logits.device))


def batch(vocab: int = 500):
    torch.manual_seed(0)
    logits = torch.randn(4, vocab) * 4
    prompts = [[5, 6, 7, 5, 300], [1, 2], [9, 10, 11], [3]]
    completions = [[7, 8, 8, 3, 3, 3], [2, 2, 400], [], [12, 12]]
    return logits, prompts, completions


def test_repetition_penalty_equals_hfs_processor_over_prompt_and_completion():
    logits, prompts, completions = batch()
    penalties = [1.3, 0.7, 1.5, 1.0]  # the last row has none
    ours = processed(logits, [(SamplingParams(repetition_penalty=p), pr, c)
                              for p, pr, c in zip(penalties, prompts, completions)])
    for i, (p, pr, c) in enumerate(zip(penalties, prompts, completions)):
        reference = RepetitionPenaltyLogitsProcessor(p)(torch.tensor([pr + c]), logits[i:i + 1].clone())[0]
        assert torch.equal(ours[i], reference), i


def test_presence_and_frequency_penalties_follow_openais_formula_over_the_completion_only():
    logits, prompts, completions = batch()
    params = [(0.5, 0.5), (-1.0, 2.0), (2.0, 0.0), (0.0, -0.3)]
    ours = processed(logits, [(SamplingParams(presence_penalty=p, frequency_penalty=f), pr, c)
                              for (p, f), pr, c in zip(params, prompts, completions)])
    for i, ((p, f), pr, c) in enumerate(zip(params, prompts, completions)):
        reference = openai_penalties(p, f, len(pr))(torch.tensor([pr + c]), logits[i:i + 1])[0]
        assert torch.equal(ours[i], reference), i
    assert torch.equal(ours[0, 5], logits[0, 5])  # a prompt token, never generated: no penalty


def test_logit_bias_and_min_tokens_change_only_their_tokens_and_leave_the_raw_logits():
    logits, prompts, completions = batch()
    raw = logits.clone()
    rows = [(SamplingParams(logit_bias={4: 5.0, 9: -100}), prompts[0], completions[0]),
            (SamplingParams(min_tokens=4, stop_token_ids=[17]), prompts[1], completions[1]),  # 3 < 4: held back
            (SamplingParams(min_tokens=3, stop_token_ids=[17], logit_bias={17: 9.0}), prompts[2], completions[2]),
            (SamplingParams(min_tokens=2, stop_token_ids=[17]), prompts[3], completions[3])]  # 2 done: free
    ours = processed(logits, rows)
    expected = logits.clone()
    expected[0, 4] += 5.0
    expected[0, 9] -= 100
    expected[1, [EOS, 17]] = float("-inf")
    expected[2, [EOS, 17]] = float("-inf")  # a bias does not free a held-back token
    assert torch.equal(ours, expected) and torch.equal(logits, raw)


def test_min_tokens_holds_back_eos_only_where_it_would_stop():
    logits, prompts, _ = batch()
    ours = processed(logits[:1], [(SamplingParams(min_tokens=1, ignore_eos=True), prompts[0], [])])
    assert torch.equal(ours, logits[:1])


def test_a_batch_without_processing_builds_nothing_and_keeps_its_logits():
    logits, prompts, completions = batch()
    states = [(SamplingParams(temperature=0.7, top_k=5), p + c, len(p), None, []) for p, c in zip(prompts, completions)]
    assert build_logits_processors(states, {EOS}, logits.device) is None
    assert apply_logits_processors(logits, None) is logits  # float32 already: not even a copy


@pytest.mark.parametrize("min_p, temperature", [(0.05, 1.0), (0.3, 0.7), (0.9, 2.0), (0.0, 1.0)])
def test_min_p_keeps_what_hfs_min_p_warper_keeps(min_p, temperature):
    logits, _, _ = batch(vocab=5000)
    ours = Sampler._min_p(logits / temperature, [min_p] * len(logits))
    reference = MinPLogitsWarper(min_p)(None, logits / temperature)
    assert torch.equal(ours.isfinite(), reference.isfinite())
    assert (ours.isfinite().sum() < logits.numel()) == (min_p > 0)  # something is cut, unless min_p is 0


def test_min_p_filters_only_its_rows_and_is_sampled_from():
    logits = torch.tensor([[3.0, 2.0, 0.0], [3.0, 2.0, 0.0]]).repeat(1000, 1)
    n = len(logits)
    tokens = Sampler()(logits, [1.0] * n, [-1] * n, [1.0] * n, [None] * n, [0] * n, min_ps=[0.5, 0.0] * (n // 2))
    assert set(tokens[0::2].tolist()) == {0} and set(tokens[1::2].tolist()) == {0, 1, 2}


def test_logit_bias_is_added_before_temperature():
    logits = torch.zeros(4000, 2)
    rows = [(SamplingParams(temperature=2.0, logit_bias={1: 4.0}), [0], [])] * len(logits)
    states = [(p, pr + c, len(pr), None, []) for p, pr, c in rows]
    n = len(logits)
    tokens = Sampler()(logits, [2.0] * n, [-1] * n, [1.0] * n, [None] * n, [0] * n,
                       processors=build_logits_processors(states, {EOS}, logits.device))
    # softmax([0, 4] / 2)[1] = 0.88; added after temperature it would be softmax([0, 4])[1] = 0.98
    assert 0.85 < tokens.float().mean() < 0.91


@pytest.mark.parametrize("params", [
    SamplingParams(logit_bias={1: 1e39}),  # inf in float32
    SamplingParams(logit_bias={1: 1e39}, min_tokens=2, stop_token_ids=[1]),  # inf plus a hold-back's -inf
    SamplingParams(repetition_penalty=1e-38),  # divides the seen tokens' logits past float32's range
])
@pytest.mark.parametrize("temperature", [1.0, 1e-6])
def test_a_logit_pushed_past_floats_range_stays_finite_and_wins(params, temperature):
    """Without the cap, the row's softmax is NaN and its samples are noise (any token at all)."""
    n = 2000
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]]).repeat(n, 1)
    seen = [1, 3]  # the prompt: token 1 has a positive logit, so the penalty makes it the largest
    states = [(params, seen, len(seen), {}, [])] * n
    processors = build_logits_processors(states, {EOS}, logits.device)
    assert not apply_logits_processors(logits, processors).isnan().any()
    tokens = Sampler()(logits, [temperature] * n, [-1] * n, [1.0] * n, [None] * n, [0] * n, processors=processors)
    if params.min_tokens:  # held back, token 1 is out however large its bias
        assert set(tokens.tolist()) <= {0, 3} and 0 in tokens
    else:
        assert set(tokens.tolist()) == {1}


# -- greedy decoding on a tiny model, against HF's forward with HF's processors --------------------

PROMPTS = [[5, 17, 17, 40, 5, 99, 300, 17], list(range(100, 137)), [7, 7, 7]]
# The tiny random model seldom repeats a token by itself: a bias on a few tokens (some in the
# prompts) makes it choose among them, so the penalties decide every step.
BIAS = {t: 10.0 for t in (300, 301, 302, 17, 40)}
PARAMS = {
    "repetition": dict(repetition_penalty=1.8),
    "repetition_below_one": dict(repetition_penalty=0.6),
    "presence_frequency": dict(presence_penalty=1.5, frequency_penalty=2.0),
    "all": dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1),
}


def hf_processors(params: dict, prompt_len: int, eos: int) -> list:
    procs = []
    if "logit_bias" in params:
        procs.append(SequenceBiasLogitsProcessor({(t,): b for t, b in params["logit_bias"].items()}))
    if params.get("repetition_penalty", 1) != 1:
        procs.append(RepetitionPenaltyLogitsProcessor(params["repetition_penalty"]))
    if params.get("min_tokens"):
        procs.append(MinNewTokensLengthLogitsProcessor(prompt_len, params["min_tokens"], eos))
    if params.get("presence_penalty") or params.get("frequency_penalty"):
        procs.append(openai_penalties(params.get("presence_penalty", 0), params.get("frequency_penalty", 0),
                                      prompt_len))
    return procs


@torch.inference_mode()
def hf_greedy(hf, prompt: list[int], params: dict, max_tokens: int, eos: int | None = None) -> list[int]:
    """HF's logits, processed by HF's processors, argmax; until ``eos`` or ``max_tokens``."""
    ids = list(prompt)
    procs = hf_processors(params, len(prompt), eos if eos is not None else -1)
    while len(ids) - len(prompt) < max_tokens and (eos is None or ids[-1] != eos or len(ids) == len(prompt)):
        scores = hf(torch.tensor([ids])).logits[:, -1].float()
        for proc in procs:
            scores = proc(torch.tensor([ids]), scores)
        ids.append(int(scores.argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("name", PARAMS)
def test_greedy_tokens_equal_hfs_processors_step_by_step(llm, hf, name):
    params = dict(PARAMS[name], logit_bias=BIAS)
    biased = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logit_bias=BIAS),
                          use_tqdm=False)
    got = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, **params),
                       use_tqdm=False)
    expected = [hf_greedy(hf, p, params, 12) for p in PROMPTS]
    assert [o["token_ids"] for o in got] == expected
    assert [o["token_ids"] for o in got] != [b["token_ids"] for b in biased]  # the penalty changed tokens


def test_min_tokens_holds_back_eos_and_stop_token_ids_as_hf_does(llm, hf):
    eos = llm.tokenizer.eos_token_id
    for stop in ({}, {"stop_token_ids": [450]}):
        held = stop.get("stop_token_ids", [eos])[0]
        params = dict(logit_bias={held: 50.0}, min_tokens=5)
        out = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=12, ignore_eos=bool(stop),
                                                       **stop, **params), use_tqdm=False)[0]
        assert out["token_ids"] == hf_greedy(hf, PROMPTS[0], params, 12, eos=held)
        assert len(out["token_ids"]) == 6 and out["token_ids"][-1] == held and out["finish_reason"] == "stop"
        unheld = SamplingParams(temperature=0, max_tokens=12, ignore_eos=bool(stop), **stop, logit_bias={held: 50.0})
        assert llm.generate(PROMPTS[:1], unheld, use_tqdm=False)[0]["token_ids"] == [held]


def test_each_of_n_samples_counts_its_own_tokens(llm, hf):
    params = dict(PARAMS["all"], logit_bias=BIAS)
    out = llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, n=3, **params),
                       use_tqdm=False)
    for prompt, request in zip(PROMPTS, out):
        assert [o["token_ids"] for o in request["outputs"]] == [hf_greedy(hf, prompt, params, 10)] * 3


def test_preempted_sequences_keep_their_counts(tiny_models, llm):
    prompts = [list(range(100, 140)), list(range(103, 130))]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, n=2, logit_bias=BIAS, **PARAMS["all"])
    expected = llm.generate(prompts, params, use_tqdm=False)
    tight = LLM(tiny_models["llama"], dtype="float32", device="cpu", kvcache_block_size=16, num_kvcache_blocks=12)
    got = tight.generate(prompts, params, use_tqdm=False)
    assert tight.stats()["num_preemptions"] > 0
    assert [[o["token_ids"] for o in r["outputs"]] for r in got] == [[o["token_ids"] for o in r["outputs"]]
                                                                      for r in expected]


def test_seeded_penalized_samples_do_not_depend_on_their_batch(llm):
    params = SamplingParams(temperature=0.8, max_tokens=10, seed=5, n=2, min_p=0.05, logit_bias=BIAS, **PARAMS["all"])
    alone = llm.generate(PROMPTS[1:2], params, use_tqdm=False)[0]["outputs"]
    crowded = llm.generate(PROMPTS, [SamplingParams(n=2), params, SamplingParams(frequency_penalty=1)],
                           use_tqdm=False)[1]["outputs"]
    assert [o["token_ids"] for o in alone] == [o["token_ids"] for o in crowded]


@torch.inference_mode()
def test_logprobs_stay_the_raw_distributions(llm, hf):
    prompt = PROMPTS[2]  # the model repeats a token at its 11th step, unless penalized
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3,
                                                **PARAMS["repetition"]), use_tqdm=False)[0]
    tokens, logprobs = out["token_ids"], out["outputs"][0]["logprobs"]
    raw = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float().log_softmax(-1)
    assert any(t != int(r.argmax()) for t, r in zip(tokens, raw))  # the penalty picked another token
    for ours, reference in zip(logprobs, raw):
        assert set(reference.topk(3).indices.tolist()) <= ours.keys()
        assert all(abs(lp - reference[t].item()) < 1e-3 for t, lp in ours.items())


@pytest.mark.parametrize("kwargs, field", [
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -2.1}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"min_p": 1.5}, "min_p"), ({"min_p": -0.1}, "min_p"),
    ({"min_tokens": 10, "max_tokens": 5}, "min_tokens"), ({"min_tokens": -1}, "min_tokens"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias"), ({"logit_bias": {5: float("nan")}}, "logit_bias"),
])
def test_invalid_logits_processing_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("field", ["logit_bias", "stop_token_ids"])
def test_token_ids_outside_the_vocabulary_are_refused_before_anything_is_queued(llm, field):
    ids = {"logit_bias": {llm.vocab_size: 1.0}, "stop_token_ids": [llm.vocab_size]}[field]
    with pytest.raises(ValueError, match=field):
        llm.generate(PROMPTS[:1], SamplingParams(min_tokens=2, **{field: ids}), use_tqdm=False)
    assert not llm.has_unfinished_requests()


def test_bad_words_ban_the_token_that_would_complete_a_word():
    logits, prompts, _ = batch()
    words = [[7], [8, 9], [3, 4, 5]]  # one token; two; three
    rows = [([], {7}), ([8], {7, 9}), ([3, 4], {7, 5}), ([4, 3, 8], {7, 9}), ([3], {7})]
    states = [(SamplingParams(), prompts[1] + completion, len(prompts[1]), None, words) for completion, _ in rows]
    ours = apply_logits_processors(logits[:1].repeat(len(rows), 1), build_logits_processors(states, {EOS}, logits.device))
    for row, (_, banned) in zip(ours, rows):
        assert set((row == float("-inf")).nonzero().flatten().tolist()) == banned
    # the prompt does not start a word: prompt [.., 2] then 9 is no match for [2, 9]
    state = (SamplingParams(), [1, 2], 2, None, [[2, 9]])
    assert build_logits_processors([state], {EOS}, logits.device) is None


def test_allowed_token_ids_keep_only_their_tokens_and_a_grammar_narrows_them():
    logits, prompts, completions = batch()

    def mask(ids):
        m = torch.zeros(logits.shape[1], dtype=torch.bool)
        m[ids] = True
        return m
    by_grammar = (torch.tensor([2]), mask([9, 10, 11])[None])  # row 2 follows a grammar too
    allowed = restrict(by_grammar, [mask([4, 9, 400]), None, mask([9, 12])], logits.device)
    params = [SamplingParams(), SamplingParams(), SamplingParams(logit_bias={9: -5.0, 10: 3.0})]
    states = [(p, pr + c, len(pr), None, []) for p, pr, c in zip(params, prompts, completions)]
    ours = apply_logits_processors(logits[:3], build_logits_processors(states, {EOS}, logits.device, allowed))
    assert ours[0].isfinite().nonzero().flatten().tolist() == [4, 9, 400]
    assert torch.equal(ours[0, [4, 9, 400]], logits[0, [4, 9, 400]]) and torch.equal(ours[1], logits[1])
    assert ours[2].isfinite().nonzero().flatten().tolist() == [9] and ours[2, 9] == logits[2, 9] - 5


def test_a_restricted_row_the_bans_would_empty_takes_its_allowed_tokens_as_ranked():
    """min_tokens' hold-back and bad_words covering every allowed token would leave a row of -inf
    (nonsense, or a token a grammar refuses, which fails the step): the restriction wins instead."""
    logits, prompts, _ = batch()
    mask = torch.zeros(logits.shape[1], dtype=torch.bool)
    mask[[EOS, 7]] = True
    params = SamplingParams(min_tokens=3)  # holds EOS back
    states = [(params, prompts[0], len(prompts[0]), None, [[7]]), (params, prompts[1], len(prompts[1]), None, [])]
    allowed = restrict(None, [mask, mask], logits.device)
    ours = apply_logits_processors(logits[:2], build_logits_processors(states, {EOS}, logits.device, allowed))
    assert ours[0].isfinite().nonzero().flatten().tolist() == [EOS, 7] == sorted([EOS, 7])  # both banned: both back
    assert torch.equal(ours[0, [EOS, 7]], logits[0, [EOS, 7]])
    assert ours[1].isfinite().nonzero().flatten().tolist() == [7]  # EOS held back, 7 left: as usual


def test_a_grammar_wins_where_allowed_token_ids_allow_none_of_its_tokens():
    mask = lambda ids: torch.zeros(10, dtype=torch.bool).index_fill_(0, torch.tensor(ids), True)  # noqa: E731
    rows, masks = restrict((torch.tensor([0, 1]), torch.stack([mask([1, 2]), mask([3])])), [mask([2, 5]), mask([4])],
                           torch.device("cpu"))
    assert rows.tolist() == [0, 1] and masks[0].nonzero().flatten().tolist() == [2]  # in common
    assert masks[1].nonzero().flatten().tolist() == [3]  # nothing in common: the grammar's
