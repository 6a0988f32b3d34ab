"""Sequence groups: n samples of one prompt, logprobs against HF, stop conditions, chat.

HF transformers on the same float32 weights is the oracle for logprobs: the log-softmax of its
raw logits, whatever the request's temperature, top-k and top-p.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM

from nanoengine import LLM, BeamSearchParams, SamplingParams
from nanoengine.cpu_library import cpu_features

PROMPT = list(range(100, 140))  # 40 tokens: two full 16-token blocks and a partial third


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(tiny_models["llama"], dtype="float32", device="cpu", kvcache_block_size=16, num_kvcache_blocks=256)


@pytest.fixture(scope="module")
def hf(tiny_models):
    return AutoModelForCausalLM.from_pretrained(tiny_models["llama"], dtype=torch.float32).eval()


@torch.inference_mode()
def hf_logprobs(hf, token_ids: list[int]) -> torch.Tensor:
    """HF's log-softmax at every position: row i is the distribution of token i + 1."""
    return hf(torch.tensor([token_ids])).logits[0].float().log_softmax(-1)


def assert_logprobs_match(ours: dict[int, float], reference: torch.Tensor, token: int, k: int) -> None:
    top = reference.topk(k)
    assert token in ours and abs(ours[token] - reference[token].item()) < 1e-3
    assert set(top.indices.tolist()) <= set(ours) and len(ours) <= k + 1
    for t, lp in ours.items():
        assert abs(lp - reference[t].item()) < 1e-3


@pytest.mark.parametrize("params", [dict(temperature=0), dict(temperature=0.7, top_k=5, top_p=0.9, seed=3)])
def test_sample_logprobs_are_hf_log_softmax_before_temperature_and_filters(llm, hf, params):
    out = llm.generate([PROMPT], SamplingParams(max_tokens=6, ignore_eos=True, logprobs=4, **params),
                       use_tqdm=False)[0]
    sample = out["outputs"][0]
    reference = hf_logprobs(hf, PROMPT + sample["token_ids"])
    assert len(sample["logprobs"]) == len(sample["token_ids"]) == 6
    for i, (token, ours) in enumerate(zip(sample["token_ids"], sample["logprobs"])):
        assert_logprobs_match(ours, reference[len(PROMPT) - 1 + i], token, 4)
    assert sample["cumulative_logprob"] == pytest.approx(sum(d[t] for t, d in zip(sample["token_ids"],
                                                                                    sample["logprobs"])))


def test_prompt_logprobs_are_hf_log_softmax_of_each_prompt_token(llm, hf):
    llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # fills the prefix cache
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3), use_tqdm=False)[0]
    reference = hf_logprobs(hf, PROMPT)
    assert len(out["prompt_logprobs"]) == len(PROMPT) and out["prompt_logprobs"][0] is None
    for i, ours in enumerate(out["prompt_logprobs"][1:], start=1):
        assert_logprobs_match(ours, reference[i - 1], PROMPT[i], 3)
    assert llm.stats()["kvcache_blocks_in_use"] == 0


def test_greedy_n1_keeps_its_keys_and_pays_for_no_logprobs(llm):
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0]
    (sample,) = out["outputs"]
    assert {k: sample[k] for k in ("text", "token_ids", "finish_reason")} == \
        {k: out[k] for k in ("text", "token_ids", "finish_reason")}
    assert sample["logprobs"] is None and sample["cumulative_logprob"] is None and out["prompt_logprobs"] is None
    assert out["text"] == llm.tokenizer.decode(out["token_ids"], skip_special_tokens=True)


def test_parallel_samples_compute_the_prompt_once_and_share_its_blocks(llm):
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, n=4, seed=7)
    prompt = [t + 200 for t in PROMPT]  # nothing of it in the prefix cache
    before = llm.stats()
    request_id = llm.add_request(prompt, params)
    stepped = llm.step()  # the prefill: one sequence, then four
    assert len(stepped) == 4 and {s.sample_index for s in stepped} == {0, 1, 2, 3}
    assert llm.stats()["prefill_tokens"] - before["prefill_tokens"] == len(prompt)
    assert llm.stats()["kvcache_blocks_in_use"] == 3  # the prompt's three blocks, each held four times
    llm.step()  # each writes into the shared partial block: three copy it, the last keeps it
    assert llm.stats()["kvcache_blocks_in_use"] == 3 + 3
    group = llm.requests[request_id].group
    while llm.has_unfinished_requests():
        llm.step()
    assert llm.stats()["kvcache_blocks_in_use"] == 0 and llm.stats()["prefill_tokens"] == before["prefill_tokens"] + 40
    again = llm.generate([prompt], params, use_tqdm=False)[0]["outputs"]
    assert [s.completion_token_ids for s in group] == [o["token_ids"] for o in again]  # seeded: reproducible
    assert len({tuple(o["token_ids"]) for o in again}) > 1  # and each sample its own stream


def test_seeded_samples_do_not_depend_on_their_batch(llm):
    # A low temperature: float32 logits differ in their last bits between batch shapes, which at a
    # flat distribution (the tiny model's at temperature 1) can move a token across a CDF boundary.
    params = SamplingParams(temperature=0.3, max_tokens=6, n=3, seed=11)
    alone = llm.generate([PROMPT], params, use_tqdm=False)[0]["outputs"]
    crowded = llm.generate([PROMPT[:9], PROMPT, PROMPT[5:]], [SamplingParams(n=2), params, SamplingParams()],
                           use_tqdm=False)[1]["outputs"]
    assert [o["token_ids"] for o in alone] == [o["token_ids"] for o in crowded]
    assert len({tuple(o["token_ids"]) for o in alone}) > 1


@pytest.mark.skipif("avx512_bf16" not in cpu_features().split(),
                    reason="bfloat16 is dtype='auto''s pick on CPU only where the cores have AVX512-BF16")
def test_seeded_samples_in_bfloat16_do_not_depend_on_their_batch_or_on_mixed_steps():
    """bfloat16 rounds coarsely enough that any difference in a sequence's arithmetic between batch
    shapes flips a seeded sample within a few tokens (the default model, alone against beside one
    other request, diverged at token 3): decode attention must compute a sequence the same way
    whatever its batch, and so must a step that mixes its decode with other prompts' chunks."""
    llm = LLM(dtype="bfloat16", max_model_len=256, enable_chunked_prefill=True, max_num_batched_tokens=64)
    target = "Write a short story about a lighthouse keeper who"
    others = ["Tell me about the history of " * 6, "Why is the sky " * 10, "A poem about coffee and"]
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=24, ignore_eos=True)
    other_params = SamplingParams(seed=5, max_tokens=24, ignore_eos=True)
    alone = llm.generate([target], params, use_tqdm=False)[0]["token_ids"]
    for k in (1, 3):  # batches of 2 and 4 from the start
        assert llm.generate([target, *others[:k]], [params] + [other_params] * k, use_tqdm=False)[0]["token_ids"] \
            == alone
    for arrivals in ({1}, {3, 9}):  # others arrive while it decodes: their chunks share its steps
        seq = llm.requests[llm.add_request(target, params)]
        step = 0
        while not seq.is_finished:
            for prompt in others if step in arrivals else []:
                llm.add_request(prompt, other_params)
            llm.step()
            step += 1
        while llm.has_unfinished_requests():
            llm.step()
        assert seq.completion_token_ids == alone, arrivals


def test_preempted_group_samples_the_same_tokens(tiny_models, llm):
    """Each forked sample is preempted and recomputed on its own; greedy, since a recompute's
    float32 logits may differ in their last bits from the decode steps' (so may a sampled token)."""
    prompts = [PROMPT, PROMPT[3:30]]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, n=3)
    expected = llm.generate(prompts, params, use_tqdm=False)
    tight = LLM(tiny_models["llama"], dtype="float32", device="cpu", kvcache_block_size=16, num_kvcache_blocks=12)
    got = tight.generate(prompts, params, use_tqdm=False)
    assert tight.stats()["num_preemptions"] > 0 and tight.stats()["kvcache_blocks_in_use"] == 0
    assert [[o["token_ids"] for o in r["outputs"]] for r in got] == [[o["token_ids"] for o in r["outputs"]]
                                                                      for r in expected]


def test_failed_step_after_a_fork_aborts_every_sample(llm, monkeypatch):
    calls, run = [], llm.model_runner.run

    def fail_when_copying(seqs, blocks_to_copy=()):  # the first step after the fork copies blocks
        if blocks_to_copy:
            calls.append(blocks_to_copy)
            raise RuntimeError("injected")
        return run(seqs, blocks_to_copy)
    monkeypatch.setattr(llm.model_runner, "run", fail_when_copying)
    with pytest.raises(RuntimeError, match="injected"):
        llm.generate([PROMPT], SamplingParams(n=3, max_tokens=4), use_tqdm=False)
    assert calls and llm.stats()["kvcache_blocks_in_use"] == 0 and not llm.has_unfinished_requests()


def test_stop_string_split_across_tokens_cuts_the_text(llm):
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    full = llm.generate([PROMPT], greedy, use_tqdm=False)[0]
    tokens = [llm.tokenizer.decode([t]) for t in full["token_ids"]]
    i = next(i for i in range(2, len(tokens) - 1) if tokens[i] and tokens[i + 1])
    stop = tokens[i][-1] + tokens[i + 1][:1]  # the last character of one token and the first of the next
    start = full["text"].find(stop)
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=["\x00", stop]),
                       use_tqdm=False)[0]
    assert out["text"] == full["text"][:start] and out["finish_reason"] == "stop"
    assert out["token_ids"] == full["token_ids"][:len(out["token_ids"])] and len(out["token_ids"]) < 16


def test_stop_token_ids_end_the_sample_with_that_token(llm):
    full = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    stop_id = full["token_ids"][4]
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_id]),
                       use_tqdm=False)[0]
    end = full["token_ids"].index(stop_id) + 1
    assert out["token_ids"] == full["token_ids"][:end] and out["finish_reason"] == "stop"


def test_chat_equals_generate_on_the_templates_token_ids(llm):
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    template_ids = llm.tokenizer.apply_chat_template(conversation, tokenize=True, add_generation_prompt=True,
                                                     return_dict=False)
    greedy = SamplingParams(temperature=0, max_tokens=8)
    expected = [{**out, "prompt": llm.tokenizer.decode(template_ids)}  # vLLM's prompt of a chat: the template's text
                for out in llm.generate([template_ids], greedy, use_tqdm=False)]
    assert llm.chat(conversation, greedy, use_tqdm=False) == expected
    assert llm.chat([conversation, conversation], greedy, use_tqdm=False) == expected * 2
    # The template's ids, not its text encoded again with special tokens (no second BOS).
    assert llm.chat_prompt(conversation) == template_ids


def test_chat_continues_a_final_message_or_leaves_the_generation_prompt_out_as_vllm_does(llm):
    asked = [{"role": "user", "content": "Name a colour."}]
    begun = asked + [{"role": "assistant", "content": "The colour is"}]
    greedy = SamplingParams(temperature=0, max_tokens=6)
    for conversation, options in ((begun, dict(add_generation_prompt=False, continue_final_message=True)),
                                  (asked, dict(add_generation_prompt=False))):
        template_ids = llm.tokenizer.apply_chat_template(conversation, tokenize=True, return_dict=False, **options)
        assert llm.chat_prompt(conversation, **options) == template_ids
        (chat,) = llm.chat(conversation, greedy, use_tqdm=False, **options)
        assert chat == {**llm.generate([template_ids], greedy, use_tqdm=False)[0],
                        "prompt": llm.tokenizer.decode(template_ids)}
    assert llm.tokenizer.decode(llm.chat_prompt(begun, add_generation_prompt=False, continue_final_message=True)) \
        .endswith("The colour is")  # left open: no end-of-turn token after it
    with pytest.raises(ValueError, match="set add_generation_prompt=False"):
        llm.chat(begun, greedy, continue_final_message=True, use_tqdm=False)


def test_chat_reads_openais_content_parts_as_the_server_does(llm):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Name"}, {"type": "text", "text": "a colour."}]}]
    assert llm.chat_prompt(parts) == llm.chat_prompt([{"role": "user", "content": "Name\na colour."}])
    with pytest.raises(ValueError, match="content parts"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], SamplingParams(),
                 use_tqdm=False)


@pytest.mark.parametrize("kwargs, field", [
    ({"n": 0}, "n"), ({"n": 1.5}, "n"), ({"logprobs": -1}, "logprobs"), ({"prompt_logprobs": -2}, "prompt_logprobs"),
    ({"stop_token_ids": ["2"]}, "stop_token_ids"), ({"stop_token_ids": [1.0]}, "stop_token_ids"),
    ({"stop": [""]}, "stop"), ({"stop": [3]}, "stop"),
])
def test_invalid_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, field", [
    ({"beam_width": 0, "max_tokens": 4}, "beam_width"), ({"beam_width": 2, "max_tokens": 0}, "max_tokens"),
    ({"beam_width": 2, "max_tokens": 4, "length_penalty": "long"}, "length_penalty"),
    ({"beam_width": 2, "max_tokens": 4, "length_penalty": float("nan")}, "length_penalty"),
])
def test_invalid_beam_search_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        BeamSearchParams(**kwargs)


def test_bad_chat_and_beam_search_calls_raise_before_anything_is_queued(llm):
    with pytest.raises(ValueError, match="conversation"):
        llm.chat([["not a message"]], SamplingParams(), use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.beam_search([PROMPT], BeamSearchParams(beam_width=2, max_tokens=llm.config.max_model_len))
    assert not llm.has_unfinished_requests() and llm.stats()["kvcache_blocks_in_use"] == 0


def test_chunked_prefill_forks_and_computes_prompt_logprobs_as_a_whole_prompt_does(tiny_models, llm):
    """With chunked prefill a prompt is computed over several steps; it samples (and forks) only
    when its last chunk is computed, and each chunk adds its positions' prompt logprobs."""
    chunked = LLM(tiny_models["llama"], dtype="float32", device="cpu", kvcache_block_size=16, num_kvcache_blocks=256,
                  enable_chunked_prefill=True, max_num_batched_tokens=24, max_num_seqs=8)
    params = [SamplingParams(temperature=0, max_tokens=5, n=2, prompt_logprobs=2, logprobs=1),
              SamplingParams(temperature=0.3, seed=2, max_tokens=5, n=3)]
    prompts = [PROMPT, [t + 7 for t in PROMPT]]
    got, expected = chunked.generate(prompts, params, use_tqdm=False), llm.generate(prompts, params, use_tqdm=False)
    assert chunked.stats()["prefill_steps"] > 2 and chunked.stats()["kvcache_blocks_in_use"] == 0
    for g, e in zip(got, expected):
        assert [o["token_ids"] for o in g["outputs"]] == [o["token_ids"] for o in e["outputs"]]
    assert len(got[0]["prompt_logprobs"]) == len(PROMPT)
    for g, e in zip(got[0]["prompt_logprobs"][1:], expected[0]["prompt_logprobs"][1:]):
        assert g.keys() == e.keys() and all(abs(g[t] - e[t]) < 1e-4 for t in g)


def test_samples_never_outnumber_max_num_seqs_and_an_impossible_n_is_refused(tiny_models):
    llm = LLM(tiny_models["llama"], dtype="float32", device="cpu", max_num_seqs=4, kvcache_block_size=16)
    with pytest.raises(ValueError, match="max_num_seqs"):
        llm.generate([PROMPT], SamplingParams(n=5), use_tqdm=False)
    step, most = llm.step, [0]

    def counting_step():
        out = step()
        most[0] = max(most[0], len(llm.scheduler.running))
        return out
    llm.step = counting_step
    out = llm.generate([PROMPT, PROMPT[:20]], SamplingParams(n=3, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert most[0] <= 4 and all(len(o["outputs"]) == 3 for o in out)
    assert all(len(s["token_ids"]) == 6 for o in out for s in o["outputs"])
