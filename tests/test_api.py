"""The public API's contract: validation errors that leave the engine usable, output shapes."""

import numpy as np
import pytest

from nanoengine import LLM, BeamSearchParams, SamplingParams
from tests.conftest import make_tiny_model


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(tiny_models["llama"], dtype="float32", max_model_len=64, kvcache_block_size=16)


GREEDY = SamplingParams(temperature=0, max_tokens=4)


def assert_still_usable(llm):
    out = llm.generate(["hello there"], GREEDY, use_tqdm=False)
    assert len(out[0]["token_ids"]) >= 1 and out[0]["finish_reason"] in ("stop", "length")
    assert llm.stats()["kvcache_blocks_in_use"] == 0


@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": -0.1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"), ({"top_k": 1.5}, "top_k"), ({"max_tokens": 0}, "max_tokens"),
    # the wrong type: a ValueError naming the field, not a TypeError from a comparison inside
    ({"temperature": "0.7"}, "temperature"), ({"temperature": None}, "temperature"),
    ({"temperature": float("inf")}, "temperature"), ({"top_p": "1"}, "top_p"), ({"top_k": None}, "top_k"),
    ({"max_tokens": True}, "max_tokens"), ({"seed": "3"}, "seed"), ({"presence_penalty": "x"}, "presence_penalty"),
    ({"repetition_penalty": None}, "repetition_penalty"), ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"min_p": "0.1"}, "min_p"), ({"stop": 5}, "stop"), ({"stop_token_ids": 7}, "stop_token_ids"),
    ({"logit_bias": [1]}, "logit_bias"), ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [1, -1]}, "allowed_token_ids"), ({"stop_token_ids": [-3]}, "stop_token_ids"), ({"bad_words": "word"}, "bad_words"),
    ({"bad_words": [" "]}, "bad_words"), ({"bad_words": ["\ud800"]}, "bad_words"), ({"stop": ["a\udfff"]}, "stop"),
    ({"include_stop_str_in_output": 1}, "include_stop_str_in_output"),
    ({"skip_special_tokens": None}, "skip_special_tokens"), ({"ignore_eos": "no"}, "ignore_eos"),
    ({"spaces_between_special_tokens": 0}, "spaces_between_special_tokens"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"), ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": 2.0}, "truncate_prompt_tokens"),
])
def test_invalid_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("prompts, match", [
    ([""], "empty"), ([[]], "empty"), ([list(range(65))], "max_model_len"), (["word " * 100], "max_model_len"),
    ([[1, 2, 10**9]], "vocabulary"), ([["not", "ids"]], "string or a list of token ids"), ([], "non-empty"),
])
def test_bad_prompt_raises_before_anything_is_queued(llm, prompts, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(["fine prompt"] + prompts if prompts else prompts, GREEDY, use_tqdm=False)
    assert not llm.has_unfinished_requests()
    assert_still_usable(llm)


def test_prompts_come_in_vllms_forms_and_sampling_params_default_to_its_own(llm):
    ids = llm.tokenize("one two")
    expected = llm.generate(["one two"], GREEDY, use_tqdm=False)
    assert expected[0]["prompt_token_ids"] == ids
    for prompts in ("one two", {"prompt": "one two"}, [{"prompt_token_ids": ids}], ({"prompt": "one two"},),
                    [list(np.array(ids))]):  # numpy's integers
        results = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [{**r, "prompt": None} for r in results] == [{**r, "prompt": None} for r in expected]  # text or ids
    assert len(llm.generate("one two", use_tqdm=False)[0]["token_ids"]) >= 1  # SamplingParams()
    with pytest.raises(ValueError, match="prompt dict"):
        llm.generate([{"text": "one two"}], GREEDY, use_tqdm=False)
    assert_still_usable(llm)


def test_results_read_as_vllms_request_outputs_too(llm, tokenizer):
    """vLLM's quickstart loop, unchanged: every key of a result is also an attribute."""
    prompts = ["one two", {"prompt_token_ids": [5, 6, 7]}]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=3, n=2, logprobs=1), use_tqdm=False)
    for output, prompt in zip(outputs, ["one two", None]):
        assert output.prompt == prompt == output["prompt"] and output.finished
        assert output.prompt_token_ids == output["prompt_token_ids"]
        assert [o.index for o in output.outputs] == [0, 1]
        sample = output.outputs[0]
        assert (sample.text, sample.token_ids, sample.finish_reason) == (output["text"], output["token_ids"],
                                                                         output["finish_reason"])
        assert sample.logprobs == sample["logprobs"] and sample.stop_reason is None
    with pytest.raises(AttributeError, match="a result has no 'missing'"):
        outputs[0].missing
    conversation = [{"role": "user", "content": "hi"}]
    (chat,) = llm.chat(conversation, GREEDY, use_tqdm=False)
    assert chat.prompt == tokenizer.decode(llm.chat_prompt(conversation))  # the rendered template, as vLLM's
    (beams,) = llm.beam_search(["one two"], BeamSearchParams(beam_width=2, max_tokens=2))
    assert beams.sequences[0].text == beams["sequences"][0]["text"]


def test_chat_takes_a_chat_template_of_its_own(llm, tokenizer):
    """vLLM's ``LLM.chat(chat_template=...)``: the text of a Jinja template, run instead of the model's."""
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant] "
    (chat,) = llm.chat([{"role": "user", "content": "hi there"}], GREEDY, use_tqdm=False, chat_template=template)
    assert chat.prompt == "[user] hi there\n[assistant] "
    assert chat.prompt_token_ids == tokenizer("[user] hi there\n[assistant] ", add_special_tokens=False).input_ids
    with pytest.raises(ValueError, match="chat_template must be a Jinja template's text"):
        llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False, chat_template=5)
    with pytest.raises(ValueError, match="the chat template rejected the messages"):
        llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False, chat_template="{% if %}")


def test_a_field_set_after_the_params_were_made_is_checked_when_queued(llm, tiny_models):
    params = SamplingParams(max_tokens=4)
    copy = params.clone()
    params.max_tokens, copy.n = None, 2  # a clone is its own
    assert params.n == 1 and copy.max_tokens == 4
    with pytest.raises(ValueError, match="max_tokens must be an integer >= 1, got None"):
        llm.generate(["hi"], params, use_tqdm=False)
    assert_still_usable(llm)
    assert len(llm.generate(["hi"], copy, use_tqdm=False)[0]["outputs"]) == 2
    # vLLM's engine options that scripts pass: taken
    assert LLM(tiny_models["llama"], dtype="half", trust_remote_code=True, max_model_len=64).config.dtype == "float16"


def test_reset_prefix_cache_makes_the_next_prompt_compute_whole_and_waits_for_idle(llm):
    prompt = list(range(100, 140))  # two full blocks of 16
    assert llm.get_tokenizer() is llm.tokenizer
    llm.generate([prompt], GREEDY, use_tqdm=False)
    hits = llm.stats()["prefix_cache_hit_tokens"]
    llm.generate([prompt], GREEDY, use_tqdm=False)
    assert llm.stats()["prefix_cache_hit_tokens"] == hits + 32
    request_id = llm.add_request(prompt, GREEDY)
    llm.step()  # it holds blocks now
    assert llm.reset_prefix_cache() is False
    llm.abort_request(request_id)
    assert llm.reset_prefix_cache() is True
    llm.generate([prompt], GREEDY, use_tqdm=False)
    assert llm.stats()["prefix_cache_hit_tokens"] == hits + 32 + 32  # the aborted one's hit, none after the reset
    assert_still_usable(llm)


def test_string_whose_tokens_exceed_the_vocabulary_raises_before_anything_is_queued(tokenizer, tmp_path):
    small = LLM(make_tiny_model(str(tmp_path / "small"), "llama", tokenizer, vocab_size=1000),
                dtype="float32", device="cpu")
    assert max(tokenizer.encode("The weather")) >= 1000 > max(tokenizer.encode("a b c"))
    with pytest.raises(ValueError, match=r"\[3947\] are outside the model's vocabulary \[0, 1000\)"):
        small.add_request("The weather", GREEDY)  # the server's path: one request, straight from a string
    assert not small.has_unfinished_requests()
    out = small.generate(["a b c"], GREEDY, use_tqdm=False)[0]
    assert len(out["token_ids"]) >= 1 and all(t < 1000 for t in out["token_ids"])
    assert small.stats()["kvcache_blocks_in_use"] == 0


def test_sampling_params_list_must_match_prompts(llm):
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], [GREEDY], use_tqdm=False)
    assert_still_usable(llm)


@pytest.mark.parametrize("kwargs, match", [
    ({"no_such_option": 1}, "unknown option"), ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
    ({"tensor_parallel_size": 3}, "attention heads"),
    ({"device": "tpu"}, "device"), ({"dtype": "int8"}, "dtype"), ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"max_model_len": 10**6}, "max_model_len"), ({"num_kvcache_blocks": 2, "max_model_len": 64}, "KV cache"),
    ({"max_num_batched_tokens": 16, "max_model_len": 64}, "max_num_batched_tokens"),
    ({"gpu_memory_utilization": 0}, "gpu_memory_utilization"),
    ({"gpu_memory_utilization": 1.0}, "gpu_memory_utilization"),
    ({"max_logprobs": -1}, "max_logprobs"), ({"max_stop_strings": "8"}, "max_stop_strings"),
    ({"dtype": "float16", "quantization": "int8"}, "quantization='int8' needs dtype"),  # the kernel takes bf16/fp32
    ({"gpu_memory_utilization": "0.5"}, "gpu_memory_utilization"), ({"max_num_seqs": True}, "max_num_seqs"),
    ({"kvcache_block_size": True}, "kvcache_block_size"), ({"seed": "1"}, "seed"), ({"seed": True}, "seed"),
    ({"kv_cache_dtype": "int8"}, "kv_cache_dtype"),
])
def test_bad_engine_options_raise_value_error(tiny_models, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(tiny_models["llama"], **kwargs)


def test_the_engine_seed_repeats_a_run_whatever_else_draws(tiny_models):
    """Requests without a seed of their own draw from the engine's generator: two engines with one
    seed sample the same tokens, though torch's global generator is reseeded between them and the
    first engine keeps drawing; another seed samples others (24 tokens of a near-uniform tiny model)."""
    import torch
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    prompts = ["hello there", "one two three"]

    def sample(engine):
        return [o["token_ids"] for o in engine.generate(prompts, params, use_tqdm=False)]

    first = LLM(tiny_models["llama"], dtype="float32", seed=7)
    torch.manual_seed(123)
    expected = sample(first)
    torch.manual_seed(456)
    second = LLM(tiny_models["llama"], dtype="float32", seed=7)
    sample(first)  # the first engine's draws do not move the second's
    assert sample(second) == expected
    assert sample(LLM(tiny_models["llama"], dtype="float32", seed=8)) != expected


def test_missing_model_path_is_named(tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(ValueError, match="nope"):
        LLM(missing)


def test_outputs_follow_prompt_order_and_report_finish_reason(llm, tokenizer):
    prompts = ["one", [5, 6, 7, 8, 9], "a longer prompt with several words in it"]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (1, 3, 7)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o["token_ids"]) for o in outputs] == [1, 3, 7]
    assert all(o["finish_reason"] == "length" for o in outputs)
    assert outputs[2]["text"] == tokenizer.decode(outputs[2]["token_ids"], skip_special_tokens=True)
    stats = llm.stats()
    for key in ("num_kvcache_blocks", "kvcache_blocks_in_use", "num_preemptions", "prefix_cache_hit_tokens",
                "prompt_tokens", "generated_tokens"):
        assert key in stats


def test_eos_finishes_with_stop_unless_ignored(tiny_models):
    probe = LLM(tiny_models["llama"], dtype="float32")
    first = probe.generate([[7, 8, 9]], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
    # Make the greedy first token the EOS token: the sequence must stop right there.
    probe.scheduler.eos_token_ids = {first["token_ids"][0]}
    out = probe.generate([[7, 8, 9]], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0]
    assert out["finish_reason"] == "stop" and out["token_ids"] == first["token_ids"]
    out = probe.generate([[7, 8, 9]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)[0]
    assert out["finish_reason"] == "length" and len(out["token_ids"]) == 5


def test_a_stop_tokens_text_is_left_out_unless_the_stop_is_included(llm, tokenizer):
    """As in vLLM: a stop token (here an ordinary one, from stop_token_ids) ends the text without
    appearing in it; include_stop_str_in_output shows it, as it shows a stop string."""
    greedy = llm.generate(["hello there"], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                          use_tqdm=False)[0]
    stop_id = greedy["token_ids"][2]
    for include in (False, True):
        out = llm.generate(["hello there"], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                           stop_token_ids=[stop_id], include_stop_str_in_output=include),
                           use_tqdm=False)[0]
        assert out["token_ids"] == greedy["token_ids"][:3] and out["finish_reason"] == "stop"
        assert out["text"] == tokenizer.decode(out["token_ids"][:3 if include else 2], skip_special_tokens=True)
        assert out["outputs"][0]["stop_reason"] == stop_id  # vLLM's: the id that stopped it
    stop = greedy["text"][len(greedy["text"]) // 2:][:2]
    out = llm.generate(["hello there"], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, stop=["zzz", stop]),
                       use_tqdm=False)[0]["outputs"][0]
    assert out["finish_reason"] == "stop" and out["stop_reason"] == stop
    assert greedy["outputs"][0]["stop_reason"] is None  # by length


def test_a_grammar_and_bans_that_leave_no_token_fail_nothing(llm):
    """A grammar that bad_words or allowed_token_ids leave no token (each alone is fine) once failed the
    whole step, and every request in it; the grammar now wins, and the request beside it is untouched."""
    pytest.importorskip("llguidance")
    from nanoengine import StructuredOutputsParams
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    alone = llm.generate(["hello there"], greedy, use_tqdm=False)[0]["token_ids"]
    for conflict in (dict(bad_words=["x"]), dict(allowed_token_ids=[5, 6])):
        constrained = SamplingParams(temperature=0, max_tokens=6, structured_outputs=StructuredOutputsParams(
            choice=["x"]), **conflict)
        beside, out = llm.generate(["hello there", "hi"], [greedy, constrained], use_tqdm=False)
        assert beside["token_ids"] == alone and out["text"] == "x" and out["finish_reason"] == "stop", conflict


def test_min_tokens_holding_back_the_whole_vocabulary_is_refused(llm):
    with pytest.raises(ValueError, match="stop_token_ids leaves no token to sample"):
        llm.generate(["hi"], SamplingParams(stop_token_ids=list(range(llm.vocab_size)), min_tokens=2), use_tqdm=False)
    assert_still_usable(llm)


def test_bad_words_and_allowed_token_ids_change_what_is_sampled(llm, tokenizer):
    greedy = llm.generate(["hello there"], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                          use_tqdm=False)[0]
    word = tokenizer.decode(greedy["token_ids"][1:2])
    out = llm.generate(["hello there"], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, bad_words=[word]),
                       use_tqdm=False)[0]
    banned = {ids[-1] for ids in llm.input_processor.bad_words_token_ids([word]) if len(ids) == 1}
    assert greedy["token_ids"][1] in banned and not banned & set(out["token_ids"])
    allowed = [5, 17, 40]
    out = llm.generate(["hello there"], SamplingParams(temperature=1.0, seed=0, max_tokens=20, ignore_eos=True,
                                                       allowed_token_ids=allowed), use_tqdm=False)[0]
    assert set(out["token_ids"]) <= set(allowed) and len(set(out["token_ids"])) > 1


def test_generation_stops_at_max_model_len(llm):
    out = llm.generate([list(range(1, 61))], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out["token_ids"]) == 4 and out["finish_reason"] == "length"  # 60 + 4 = max_model_len


@pytest.mark.parametrize("params, match", [
    (dict(logprobs=21), "logprobs=21 is more than max_logprobs=20"),
    (dict(logprobs=10**6), "logprobs=1000000 is more than max_logprobs=20"),  # topk past the vocabulary
    (dict(prompt_logprobs=21), "prompt_logprobs=21 is more than max_logprobs=20"),
    (dict(stop=["x"] * 33), "stop has 33 strings, more than max_stop_strings=32"),
    (dict(stop=["y" * 257]), "stop has a string of 257 characters, more than max_stop_string_length=256"),
    (dict(allowed_token_ids=[5, 10**9]), "allowed_token_ids names token ids"),
    (dict(bad_words=["x"] * 33), "bad_words has 33 strings, more than max_stop_strings=32"),
    (dict(bad_words=["y" * 257]), "bad_words has a string of 257 characters, more than max_stop_string_length=256"),
    (dict(allowed_token_ids=[2], min_tokens=2), "allowed_token_ids leaves no token to sample"),  # 2: EOS
    (dict(truncate_prompt_tokens=65), "truncate_prompt_tokens=65 is more than max_model_len=64"),
])
def test_a_request_over_a_limit_raises_naming_the_field_and_the_limit(llm, params, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(["fine prompt", "hello"], [GREEDY, SamplingParams(max_tokens=4, **params)], use_tqdm=False)
    assert not llm.has_unfinished_requests()
    assert_still_usable(llm)


def test_requests_at_the_limits_are_served(llm):
    params = SamplingParams(temperature=0, max_tokens=3, logprobs=20, prompt_logprobs=20, stop=["z" * 256] * 32)
    (out,) = llm.generate(["hello there"], params, use_tqdm=False)
    assert len(out["outputs"][0]["logprobs"][0]) >= 20 and len(out["prompt_logprobs"][1]) >= 20


def test_limits_are_engine_options(tiny_models):
    llm = LLM(tiny_models["llama"], dtype="float32", max_model_len=64, max_logprobs=2, max_stop_strings=1)
    with pytest.raises(ValueError, match="logprobs=3 is more than max_logprobs=2"):
        llm.generate(["hi"], SamplingParams(logprobs=3), use_tqdm=False)
    with pytest.raises(ValueError, match="max_stop_strings=1"):
        llm.generate(["hi"], SamplingParams(stop=["a", "b"]), use_tqdm=False)
    wide = LLM(tiny_models["llama"], dtype="float32", max_model_len=64, max_logprobs=10**6)
    with pytest.raises(ValueError, match=f"logprobs=100000 is more than the vocabulary's {wide.vocab_size} tokens"):
        wide.generate(["hi"], SamplingParams(logprobs=10**5), use_tqdm=False)
    with pytest.raises(ValueError, match="beam_width=4 needs the logprobs of 8 candidates a step, more than max_logp"):
        llm.beam_search(["hi"], BeamSearchParams(beam_width=4, max_tokens=2))


def test_a_prompt_too_long_by_its_characters_is_refused_before_tokenizing(llm, monkeypatch):
    """No token is longer than the vocabulary's longest, so a text longer than max_model_len of them is
    refused by its length alone: a huge prompt costs no tokenizing (seconds, and memory kept)."""
    encode = llm.tokenizer.encode
    encoded = []
    monkeypatch.setattr(llm.tokenizer, "encode",
                        lambda text, *args, **kwargs: encoded.append(len(text)) or encode(text, *args, **kwargs))
    longest = max(map(len, llm.tokenizer.get_vocab()))
    for prompt in ("a" * (64 * longest + 1), "a" * 10**7):
        with pytest.raises(ValueError, match=f"prompt has {len(prompt)} characters, more than max_model_len=64 tokens"):
            llm.generate([prompt], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="characters, more than max_model_len=64"):
        llm.chat([{"role": "user", "content": "b" * 10**7}], GREEDY, use_tqdm=False)
    assert encoded == []
    with pytest.raises(ValueError, match="max_model_len=64"):  # within the bound: tokenized, then counted
        llm.generate(["a " * (64 * longest // 2)], GREEDY, use_tqdm=False)
    assert encoded == [64 * longest]


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(llm, tokenizer, monkeypatch):
    """vLLM's left truncation: text, token ids and chat alike; a long document is cut, not refused."""
    text = "alpha beta gamma delta " * 40  # more than max_model_len=64 tokens
    kept = tokenizer.encode(text)[-10:]
    (out,) = llm.generate([text], SamplingParams(temperature=0, max_tokens=4, truncate_prompt_tokens=10), use_tqdm=False)
    assert out["prompt_token_ids"] == kept
    assert out["token_ids"] == llm.generate([kept], GREEDY, use_tqdm=False)[0]["token_ids"]
    (whole,) = llm.generate([list(range(1, 101))], SamplingParams(max_tokens=4, truncate_prompt_tokens=-1), use_tqdm=False)
    assert whole["prompt_token_ids"] == list(range(37, 101)) and whole["token_ids"]  # -1: the last max_model_len
    conversation = [{"role": "user", "content": text}]
    (chat,) = llm.chat(conversation, SamplingParams(max_tokens=2, truncate_prompt_tokens=20), use_tqdm=False)
    assert chat["prompt_token_ids"] == tokenizer.apply_chat_template(conversation, add_generation_prompt=True,
                                                                       return_dict=False)[-20:]
    # A document of 10 MB: only as much of its end as max_model_len tokens could hold is tokenized.
    encode, encoded = llm.tokenizer.encode, []
    monkeypatch.setattr(llm.tokenizer, "encode",
                        lambda text, *args, **kwargs: encoded.append(len(text)) or encode(text, *args, **kwargs))
    document = "alpha beta gamma delta " * (10**7 // 23)
    (long,) = llm.generate([document], SamplingParams(max_tokens=2, truncate_prompt_tokens=10), use_tqdm=False)
    assert long["prompt_token_ids"] == kept and encoded == [64 * max(map(len, tokenizer.get_vocab()))]
    assert_still_usable(llm)


def test_spaces_between_special_tokens_is_taken_as_vllm_takes_it_with_a_fast_tokenizer(llm, tokenizer):
    params = dict(temperature=0, max_tokens=4, ignore_eos=True, skip_special_tokens=False,
                  allowed_token_ids=[tokenizer.eos_token_id, tokenizer.bos_token_id])  # special tokens only
    texts = [llm.generate(["hello"], SamplingParams(**params, spaces_between_special_tokens=spaces), use_tqdm=False)[0]
             for spaces in (True, False)]
    assert texts[0]["text"] == texts[1]["text"] == tokenizer.decode(texts[0]["token_ids"])


@pytest.mark.parametrize("text", ["bad \ud800 surrogate", "\udfff"])
def test_a_lone_surrogate_in_a_prompt_is_a_value_error_naming_the_prompt(llm, text):
    with pytest.raises(ValueError, match="prompt is not valid Unicode text: a lone surrogate at character"):
        llm.generate([text], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="not valid Unicode text"):
        llm.chat([{"role": "user", "content": text}], GREEDY, use_tqdm=False)
    assert_still_usable(llm)


def test_an_engine_without_grammars_or_a_server_never_imports_their_libraries(tiny_models):
    """Pay for what you use: llguidance (seconds to import) and the server's libraries load at the first
    request that needs them, not with nanoengine nor with an engine that serves plain requests."""
    import subprocess
    import sys
    code = ("import sys; from nanoengine import LLM, SamplingParams; "
            f"LLM({tiny_models['llama']!r}, device='cpu').generate(['Hi'], SamplingParams(max_tokens=2), use_tqdm=False); "
            "print(sorted(m for m in ('llguidance', 'fastapi', 'uvicorn', 'openai') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "[]"
