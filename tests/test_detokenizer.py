"""The Detokenizer's streamed text against decoding all the ids at once, and stop strings cut exactly."""

import random

import pytest

from nanoengine.detokenizer import Detokenizer

TEXTS = ["Hello, world! 👋🏽 The café serves crème brûlée.", "日本語のテキスト、中文字符和한국어。",
         "emoji 🤖🧠🚀 and ZWJ 👩‍👩‍👧 families", "def f(x):\n    return x ** 2  # ∑ ∫ ≈"]


class WindowOnly:
    """The tokenizer without its Rust backend: the Detokenizer falls back to its offset window."""

    def __init__(self, tokenizer):
        self.decode = tokenizer.decode


def stream(detok: Detokenizer, ids: list[int], rng: random.Random) -> str:
    """Feed ids in chunks of 1 to 3, as engine outputs arrive, and join what comes back."""
    out, i = [], 0
    while i < len(ids) and not detok.stopped:
        n = rng.randint(1, 3)
        out.append(detok.add(ids[i:i + n], i + n >= len(ids)))
        i += n
    return "".join(out)


def random_ids(tokenizer, rng: random.Random) -> list[int]:
    """Encoded multilingual text, random vocabulary ids (lone bytes, half characters) and special tokens."""
    ids = []
    for _ in range(rng.randint(1, 6)):
        kind = rng.random()
        if kind < 0.4:
            ids += tokenizer.encode(rng.choice(TEXTS), add_special_tokens=False)
        elif kind < 0.8:
            ids += [rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 8))]
        else:
            ids += rng.sample(tokenizer.all_special_ids, 1)
    return ids


@pytest.mark.parametrize("backend", ["decode_stream", "window"])
def test_streamed_text_equals_decoding_all_ids(tokenizer, backend):
    rng = random.Random(0)
    tok = tokenizer if backend == "decode_stream" else WindowOnly(tokenizer)
    for _ in range(200):
        ids = random_ids(tokenizer, rng)
        detok = Detokenizer(tok, [])
        assert (detok.decode_stream is not None) == (backend == "decode_stream")
        expected = tokenizer.decode(ids, skip_special_tokens=True)
        assert stream(detok, ids, rng) == expected == detok.text
        assert len(detok.token_ids) == len(ids)


def test_detokenizer_never_splits_a_character_or_leaks_a_stop_string(tokenizer):
    token_ids = tokenizer.encode("héllo 🦙 wörld ✓ 日本語")  # the emoji and CJK span several tokens
    text = Detokenizer(tokenizer, [])
    deltas = [text.add([t], finished=False) for t in token_ids] + [text.add([], finished=True)]
    assert "".join(deltas) == tokenizer.decode(token_ids) and not any("\ufffd" in d for d in deltas)

    text = Detokenizer(tokenizer, ["wörld"])
    deltas = []
    for t in token_ids:
        deltas.append(text.add([t], finished=False))
        if text.stopped:
            break
    assert "".join(deltas) == text.text == "héllo 🦙 " and not any("w" in d for d in deltas)


@pytest.mark.parametrize("include_stop", [False, True])
@pytest.mark.parametrize("backend", ["decode_stream", "window"])
def test_stop_string_split_across_tokens_cuts_exactly(tokenizer, backend, include_stop):
    rng = random.Random(1)
    tok = tokenizer if backend == "decode_stream" else WindowOnly(tokenizer)
    for _ in range(100):
        text = " ".join(rng.sample(TEXTS, 3))
        start = rng.randrange(len(text) - 8)
        stop = text[start:start + rng.randint(2, 8)]
        ids = tokenizer.encode(text, add_special_tokens=False)
        detok = Detokenizer(tok, ["never there", stop], include_stop=include_stop)
        end = text.find(stop) + (len(stop) if include_stop else 0)
        assert stream(detok, ids, rng) == text[:end] == detok.text
        assert detok.stopped


def test_no_stop_string_ends_in_the_first_min_tokens_tokens_text(tokenizer):
    """vLLM's rule: min_tokens holds stop strings back as it holds EOS back."""
    ids = tokenizer.encode("one, two, three, four, two, six", add_special_tokens=False)
    first_two = next(i for i in range(len(ids)) if tokenizer.decode(ids[:i + 1]).endswith("two"))
    for min_tokens, expected in ((0, "one, "), (first_two, "one, "), (first_two + 1, "one, two, three, four, ")):
        detok, out = Detokenizer(tokenizer, ["two"], min_tokens=min_tokens), []
        for t in ids:  # one token an add, as the scheduler feeds it
            out.append(detok.add([t], False))
            if detok.stopped:
                break
        assert "".join(out) == expected == detok.text, min_tokens


@pytest.mark.parametrize("backend", ["decode_stream", "window"])
def test_special_tokens_are_written_when_not_skipped(tokenizer, backend):
    rng = random.Random(2)
    tok = tokenizer if backend == "decode_stream" else WindowOnly(tokenizer)
    for _ in range(50):
        ids = random_ids(tokenizer, rng) + tokenizer.all_special_ids[:1]
        detok = Detokenizer(tok, [], skip_special_tokens=False)
        assert stream(detok, ids, rng) == tokenizer.decode(ids, skip_special_tokens=False)


def test_stop_string_longer_than_text_sent_so_far_repeats_nothing(tokenizer):
    text = "# nanoengine\n\nA small engine."
    detok = Detokenizer(tokenizer, ["a stop string longer than the text itself"])
    out = "".join(detok.add([i], False) for i in tokenizer.encode(text, add_special_tokens=False))
    assert out + detok.add([], True) == text
    assert not detok.stopped


@pytest.mark.parametrize("backend", ["decode_stream", "window"])
def test_each_token_decodes_a_bounded_window_not_the_whole_text(tokenizer, backend):
    windows = []

    def decode(ids, **kwargs):
        windows.append(len(ids))
        return tokenizer.decode(ids, **kwargs)

    tok = WindowOnly(tokenizer)
    tok.decode = decode
    if backend == "decode_stream":
        tok.backend_tokenizer = tokenizer.backend_tokenizer
    ids = tokenizer.encode(" ".join(TEXTS * 30), add_special_tokens=False)
    detok = Detokenizer(tok, ["never there"])
    assert "".join(detok.add([i], False) for i in ids) + detok.add([], True) == tokenizer.decode(ids)
    assert max(windows, default=0) <= 8 and len(windows) <= (0 if backend == "decode_stream" else 2 * len(ids))
