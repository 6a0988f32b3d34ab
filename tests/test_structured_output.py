"""Structured output: every finished constrained output parses and matches its grammar, whatever
else shares the batch, through forks, preemption and chunked prefill.

The tiny models' weights are random, so left alone they emit noise: anything well-formed here is
the grammar's doing. Sampling is at temperature 1.0, over many seeds.
"""

import json
import re

import pytest

from nanoengine import LLM, SamplingParams, StructuredOutputsParams
from nanoengine.structured_output import ascii_classes

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

PERSON = {"type": "object", "required": ["name", "age", "address"], "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
    "address": {"type": "object", "required": ["city"], "properties": {"city": {"type": "string", "maxLength": 10}}},
}, "additionalProperties": False}
FLAGS = {"type": "object", "required": ["ok"], "properties": {"ok": {"type": "boolean"}, "n": {"type": "number"}},
         "additionalProperties": False}
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
CHOICES = ["yes", "no", "it depends"]
ARITHMETIC = 'root ::= expr\nexpr ::= term ("+" term)*\nterm ::= [0-9] | "(" expr ")"'


def check(params: StructuredOutputsParams, text: str) -> None:
    """``text`` matches ``params``' grammar."""
    if params.json is not None:
        jsonschema.validate(json.loads(text), json.loads(params.json) if isinstance(params.json, str) else params.json)
    elif params.json_object:
        assert isinstance(json.loads(text), dict)
    elif params.regex is not None:
        assert re.fullmatch(params.regex, text, re.ASCII), text  # \d is [0-9], as in vLLM's xgrammar
    elif params.choice is not None:
        assert text in params.choice
    else:
        assert re.fullmatch(r"[0-9()+]+", text) and text.count("(") == text.count(")"), text


# Grammars a random model often finishes within 128 tokens (the schemas bound their strings); json_object,
# whose keys are free text, is tested on the default model below.
CASES = [StructuredOutputsParams(json=PERSON), StructuredOutputsParams(json=json.dumps(FLAGS)),
         StructuredOutputsParams(regex=PHONE), StructuredOutputsParams(choice=CHOICES),
         StructuredOutputsParams(grammar=ARITHMETIC)]


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(tiny_models["llama"], dtype="float32", max_model_len=256)


def finished(outputs) -> list[dict]:
    samples = [sample for output in outputs for sample in output["outputs"]]
    assert all(s["finish_reason"] in ("stop", "length") for s in samples)
    return [s for s in samples if s["finish_reason"] == "stop"]


@pytest.mark.parametrize("params", CASES, ids=["schema", "schema_text", "regex", "choice", "ebnf"])
def test_every_finished_output_matches_its_grammar_at_temperature_1(llm, params):
    sampling = [SamplingParams(temperature=1.0, seed=seed, max_tokens=128, structured_outputs=params)
                for seed in range(12)]
    done = finished(llm.generate(["Answer:"] * 12, sampling, use_tqdm=False))
    assert len(done) >= 3, "a random model finishes some outputs within 128 tokens"
    for sample in done:
        check(params, sample["text"])


@pytest.mark.parametrize("regex, ascii_regex", [
    (r"\(\d{3}\) \d{3}-\d{4}", r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"), (r"\w+\W", "[0-9A-Za-z_]+[^0-9A-Za-z_]"),
    (r"[\d-]{5}", "[0-9-]{5}"), (r"[^\w.]", "[^0-9A-Za-z_.]"), (r"[\D]", "[[^0-9]]"), (r"\D", "[^0-9]"),
    (r"\\d", r"\\d"),  # an escaped backslash, then a d
    (r"[]\d]", "[]0-9]"), (r"[^]\w]", "[^]0-9A-Za-z_]"),  # a ] first in a class is a literal
    (r"[[:alpha:]\d]\p{L}\s", "[[:alpha:]0-9]\\p{L}\\s"),  # the rest as it was
])
def test_regex_digits_and_word_characters_are_ascii(regex, ascii_regex):
    assert ascii_classes(regex) == ascii_regex
    if "[[" not in ascii_regex and "\\p" not in regex:  # Rust's syntax only: nested classes, \p
        for text in ("123", "١٢٣", "abc_9", "é", "-", "]"):  # Python's re, in ASCII mode, as the reference
            assert bool(re.fullmatch(ascii_regex, text)) == bool(re.fullmatch(regex, text, re.ASCII)), text


def test_json_object_on_the_default_model_always_parses():
    llm = LLM(dtype="float32", max_model_len=512)
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=160,
                             structured_outputs=StructuredOutputsParams(json_object=True)) for seed in range(8)]
    prompt = llm.chat_prompt([{"role": "user", "content": "Describe a cat as a JSON object with a few fields."}])
    done = finished(llm.generate([prompt] * 8, params, use_tqdm=False))
    assert len(done) >= 4
    assert all(isinstance(json.loads(sample["text"]), dict) for sample in done)


def test_constrained_and_free_requests_share_a_batch_and_the_free_ones_are_untouched(llm):
    """A free request's greedy tokens are the same beside constrained ones as alone; n=2 samples of a
    constrained request each follow the grammar on their own."""
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    alone = llm.generate(["The weather today"], greedy, use_tqdm=False)[0]["token_ids"]
    mixed = [SamplingParams(temperature=1.0, seed=i, n=2, max_tokens=96, structured_outputs=p)
             for i, p in enumerate(CASES)]
    outputs = llm.generate(["The weather today"] + ["Answer:"] * len(CASES), [greedy] + mixed, use_tqdm=False)
    assert outputs[0]["token_ids"] == alone
    for params, output in zip(CASES, outputs[1:]):
        assert len(output["outputs"]) == 2
        for sample in finished([output]):
            check(params, sample["text"])


def test_a_preempted_constrained_sequence_resumes_its_grammar(tiny_models):
    """A cache of 12 blocks of 4 tokens preempts; greedy, the outputs equal a roomy cache's."""
    params = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=PERSON))] * 4
    prompts = ["Person one:", "Person two is", "Third:", "And a fourth person"]
    roomy = LLM(tiny_models["qwen2"], dtype="float32", max_model_len=64)
    tight = LLM(tiny_models["qwen2"], dtype="float32", max_model_len=64, kvcache_block_size=4, num_kvcache_blocks=20)
    expected = roomy.generate(prompts, params, use_tqdm=False)
    got = tight.generate(prompts, params, use_tqdm=False)
    assert tight.stats()["num_preemptions"] > 0
    assert [o["token_ids"] for o in got] == [o["token_ids"] for o in expected]


def test_chunked_prefill_and_prefix_hits_keep_outputs_valid(tiny_models):
    llm = LLM(tiny_models["qwen3"], dtype="float32", max_model_len=256, enable_chunked_prefill=True,
              max_num_batched_tokens=16)
    prompt = "A shared system prompt that spans a few blocks of the cache. " * 4 + "Now answer:"
    sampling = [SamplingParams(temperature=1.0, seed=i, max_tokens=96, structured_outputs=CASES[i % len(CASES)])
                for i in range(8)]
    outputs = llm.generate([prompt] * 8, sampling, use_tqdm=False)
    assert llm.stats()["prefix_cache_hit_tokens"] > 0
    for params, output in zip(sampling, outputs):
        if output["finish_reason"] == "stop":
            check(params.structured_outputs, output["text"])


def test_a_cut_output_says_length_and_ignore_eos_still_stops_at_the_grammars_end(llm):
    cut = llm.generate(["Answer:"], SamplingParams(temperature=1.0, seed=0, max_tokens=3, structured_outputs=CASES[0]),
                       use_tqdm=False)[0]
    assert cut["finish_reason"] == "length" and len(cut["token_ids"]) == 3
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=50, ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(choice=CHOICES))
    out = llm.generate(["Answer:"], params, use_tqdm=False)[0]
    assert out["finish_reason"] == "stop" and out["text"] in CHOICES


@pytest.mark.parametrize("kwargs, message", [
    (dict(json=PERSON, regex="a"), "exactly one of"),
    (dict(), "exactly one of"),
    (dict(choice=[]), "non-empty list of strings"),
    (dict(json=5), "JSON schema"),
])
def test_structured_outputs_params_are_checked_when_made(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**kwargs)


def test_a_grammar_the_library_refuses_is_a_value_error_before_anything_is_queued(llm):
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(json='{"type": "object", "properties": 5}'))
    good = SamplingParams(max_tokens=4)
    with pytest.raises(ValueError, match="structured_outputs.json is not a grammar llguidance accepts: properties"):
        llm.generate(["first", "second"], [good, bad], use_tqdm=False)
    assert not llm.has_unfinished_requests()
    assert len(llm.generate(["still usable"], good, use_tqdm=False)[0]["token_ids"]) == 4


def test_thousands_of_choices_are_served(llm):
    """A choice is one regex, a state machine, so its size does not meet the parser's limits (as
    alternatives of a grammar, 2,000 of them failed mid-answer)."""
    choices = [f"option {i}" for i in range(5000)]
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=12, structured_outputs=StructuredOutputsParams(
        choice=choices + ["a.b|c (d)"]))  # metacharacters are literal
    for output in finished(llm.generate(["Pick:"] * 4, params, use_tqdm=False)):
        assert output["text"] in choices + ["a.b|c (d)"]


def test_a_grammar_the_library_gives_up_on_mid_answer_ends_only_its_own_request(llm, caplog):
    """3,000 alternatives of a grammar overflow a row of the parser at the second token: that
    sample ends ("abort"), and the request beside it in the step runs on untouched."""
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    alone = llm.generate(["The weather today"], greedy, use_tqdm=False)[0]["token_ids"]
    huge = StructuredOutputsParams(grammar="root ::= " + " | ".join(f'"w{i}"' for i in range(3000)))
    failing, free = llm.generate(["Pick:", "The weather today"], [SamplingParams(max_tokens=8, structured_outputs=huge),
                                                                  greedy], use_tqdm=False)
    assert failing["finish_reason"] == "abort" and free["token_ids"] == alone
    assert "its grammar failed" in caplog.text and "3001 items" in caplog.text
    assert not llm.has_unfinished_requests() and llm.stats()["kvcache_blocks_in_use"] == 0


def test_a_grammar_that_leaves_no_token_to_go_on_with_is_an_abort_not_a_stop(llm, caplog):
    """A property whose schema is itself: after '{"a":' nothing can follow, and the library allows EOS
    alone. Sampled, that EOS is no "stop" (whose output matches): the sample ends "abort"."""
    itself = {"type": "object", "properties": {"a": {"$ref": "#/properties/a"}}, "required": ["a"]}
    params = SamplingParams(max_tokens=16, structured_outputs=StructuredOutputsParams(json=itself))
    (output,) = llm.generate(["Write:"], params, use_tqdm=False)
    assert output["finish_reason"] == "abort" and output["text"] == '{"a":' and "its grammar failed" in caplog.text


def test_an_object_takes_only_its_declared_properties_unless_its_schema_allows_others(llm):
    """vLLM's default backend reads a schema strictly, as OpenAI's strict mode does: a client that
    calls f(**arguments) gets the arguments it declared. A schema that allows others keeps them."""
    closed = {"type": "object", "properties": {"a": {"type": "integer"}, "inner": {
        "type": "object", "properties": {"b": {"type": "integer"}}}}}
    extra_at_top, extra_inside = '{"a":1,"z":2}', '{"a":1,"inner":{"b":2,"z":3}}'
    accepted = {}
    for name, schema in (("closed", closed), ("open", {**closed, "additionalProperties": True})):
        matcher = llm.grammars.matcher(StructuredOutputsParams(json=schema))
        for text in (extra_at_top, extra_inside, '{"a":1,"inner":{"b":2}}'):
            tokens = llm.tokenizer.encode(text, add_special_tokens=False)
            accepted[name, text] = matcher.validate_tokens(tokens) == len(tokens)
    assert not accepted["closed", extra_at_top] and not accepted["closed", extra_inside]
    assert accepted["open", extra_at_top] and accepted["closed", '{"a":1,"inner":{"b":2}}']


@pytest.mark.parametrize("params", [StructuredOutputsParams(grammar='root ::= root "a"'),
                                    StructuredOutputsParams(regex="[^\\x00-\\U0010FFFF]")])
def test_a_grammar_no_text_matches_is_refused_rather_than_answered_empty(llm, params):
    with pytest.raises(ValueError, match="no text matches it"):
        llm.generate(["x"], SamplingParams(max_tokens=4, structured_outputs=params), use_tqdm=False)
    assert not llm.has_unfinished_requests()
