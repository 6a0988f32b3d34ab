"""Per-request sampling parameters: what a user controls about how tokens are picked."""

import copy
import json as json_module
import math
import numbers
from dataclasses import dataclass


# The largest a processed logit may be (logits_processors.py). A bias past float32's range (1e39
# is inf there), or a repetition penalty small enough to divide a logit past it, would put inf in a
# row, and the softmax's inf - inf turns every probability of the row into NaN. Capped, such a token
# is simply the most likely, and stays finite through the sampler's smallest temperature (1e-6).
MAX_LOGIT = 1e30


def is_int(x) -> bool:
    """An int and not a bool (True is an int to Python, and a tensor size of 1 to torch)."""
    return isinstance(x, int) and not isinstance(x, bool)


def is_token_id(x) -> bool:
    """A token id: an integer >= 0, numpy's too (a bool is not one)."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool) and x >= 0


def is_text(x) -> bool:
    """A non-empty string that UTF-8 can encode (a lone surrogate cannot: no text holds one, and the
    tokenizer fails on it)."""
    try:
        return isinstance(x, str) and bool(x) and bool(x.encode())
    except UnicodeEncodeError:
        return False


def is_number(x) -> bool:
    """A finite real number (numpy's too): a string, None, a bool or inf would otherwise fail later,
    or worse, sample from NaN logits."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


@dataclass
class StructuredOutputsParams:
    """A grammar the output must follow (vLLM's name and fields); exactly one of them is set.

    ``json``: a JSON schema (a dict, or its text); ``json_object``: any JSON object; ``regex``: a
    regular expression; ``choice``: one of these strings; ``grammar``: a grammar in GBNF (the EBNF
    llama.cpp and xgrammar write) or Lark. structured_output.py compiles it and masks the logits.
    """

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self):
        given = [f for f in ("json", "regex", "choice", "grammar") if getattr(self, f) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError("structured_outputs takes exactly one of json, json_object, regex, choice, grammar; "
                             f"got {given or 'none'}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (a dict or its text), got {self.json!r}")
        for field in ("regex", "grammar"):
            if getattr(self, field) is not None and not isinstance(getattr(self, field), str):
                raise ValueError(f"structured_outputs.{field} must be a string, got {getattr(self, field)!r}")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError(f"structured_outputs.choice must be a non-empty list of strings, got {self.choice!r}")

    @property
    def key(self) -> tuple[str, str]:
        """(kind, text): what a compiled grammar is cached by."""
        if self.json is not None:
            return "json", self.json if isinstance(self.json, str) else json_module.dumps(self.json)
        if self.json_object:
            return "json_object", ""
        if self.choice is not None:
            return "choice", json_module.dumps(self.choice)
        return ("regex", self.regex) if self.regex is not None else ("grammar", self.grammar)


@dataclass
class SamplingParams:
    """How to sample one request's completions.

    ``temperature=0`` means greedy decoding. ``top_k=-1`` (or 0, as in vLLM) and ``top_p=1``
    switch those filters off. A ``seed`` makes the request's samples reproducible whatever else
    shares its batch: token for token in bfloat16 on CPU; in float32, whose matmuls (torch's) and
    decode attention round differently at different batch sizes, a sample may still change where
    two tokens nearly tie. (A preempted sequence's recompute runs through prefill's kernels, so its
    later samples may differ in either: docs/api.md.)
    ``n`` samples share the prompt's computation and KV blocks. ``logprobs=k`` returns, for each
    sampled token, its logprob and the ``k`` most likely tokens' (``0``: the sampled token's
    only); ``prompt_logprobs=k`` the same for every prompt token. Logprobs are those of the
    model's raw distribution, before any of the processing below, temperature, top-k and top-p. Generation stops at a
    ``stop`` string (the text is cut before it) or a token of ``stop_token_ids``.

    What a request may change in the logits before sampling, with vLLM's names and bounds
    (logits_processors.py): ``logit_bias`` adds to a token's logit; ``min_tokens`` holds back EOS
    and ``stop_token_ids`` until that many tokens were generated; ``presence_penalty`` and
    ``frequency_penalty`` (OpenAI's) lower the logit of each token the completion already holds, by
    a constant and per occurrence; ``repetition_penalty`` (HF's) divides a positive logit, or
    multiplies a negative one, of each token in the prompt or the completion. ``min_p`` drops the
    tokens less likely than ``min_p`` times the most likely one (after temperature).
    ``structured_outputs`` constrains the output to a grammar (structured_output.py): a JSON schema,
    a regex, a choice or an EBNF grammar; a finished output ("stop") then always matches it.
    ``allowed_token_ids`` keeps only those tokens; ``bad_words`` never completes one of those words
    (each as the tokenizer writes it alone and after a space, as vLLM reads them: a word's last token
    is banned wherever the completion ends in the tokens before it).

    What the text shows, as in vLLM: ``include_stop_str_in_output`` keeps the stop string that ended
    the text; ``skip_special_tokens=False`` writes special tokens (EOS, chat markers) into it.
    ``spaces_between_special_tokens`` is taken as vLLM takes it with a fast tokenizer, the only kind
    this engine loads: special tokens are written as they are, without spaces, either way.

    ``truncate_prompt_tokens=k`` keeps the prompt's last ``k`` tokens (``-1``: its last
    ``max_model_len``), as vLLM does, so that a long document is cut rather than refused.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 64
    ignore_eos: bool = False
    seed: int | None = None
    n: int = 1
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_p: float = 0.0
    min_tokens: int = 0
    structured_outputs: StructuredOutputsParams | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None

    def __post_init__(self):
        self.check()

    def check(self) -> None:
        """Check, and bring to one form, every field: when made, and again when a request is queued
        (``InputProcessor.check_sampling_params``), since a field may be set in between."""
        if not (is_number(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a number >= 0 (0 means greedy), got {self.temperature!r}")
        if not (is_number(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (disabled) or a positive integer, got {self.top_k!r}")
        if self.top_k == 0:  # vLLM's 0 means what -1 does
            self.top_k = -1
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.seed is not None and not is_int(self.seed):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if not is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        for field in ("logprobs", "prompt_logprobs"):
            value = getattr(self, field)
            if value is not None and (not is_int(value) or value < 0):
                raise ValueError(f"{field} must be None or an integer >= 0, got {value!r}")
        # One form inside the engine: a list of strings, a list of ints.
        stop = [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(map(is_text, stop)):
            raise ValueError(f"stop must be a string or a list of non-empty strings (valid Unicode), got {self.stop!r}")
        self.stop = list(stop)
        ids = [] if self.stop_token_ids is None else self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or not all(map(is_token_id, ids)):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        self.stop_token_ids = [int(t) for t in ids]
        for field in ("presence_penalty", "frequency_penalty"):
            if not (is_number(getattr(self, field)) and -2 <= getattr(self, field) <= 2):
                raise ValueError(f"{field} must be in [-2, 2], got {getattr(self, field)!r}")
        if not (is_number(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError("repetition_penalty must be a number > 0 (1 means none), "
                             f"got {self.repetition_penalty!r}")
        if not (is_number(self.min_p) and 0 <= self.min_p <= 1):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                             f"got {self.min_tokens!r}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams, got "
                             f"{type(self.structured_outputs).__name__}")
        if self.logit_bias is not None and not isinstance(self.logit_bias, dict):
            raise ValueError(f"logit_bias must map token ids to finite numbers, got {self.logit_bias!r}")
        if not all(is_token_id(t) and is_number(b) for t, b in (self.logit_bias or {}).items()):
            raise ValueError(f"logit_bias must map token ids to finite numbers, got {self.logit_bias!r}")
        self.logit_bias = {int(t): min(max(b, -MAX_LOGIT), MAX_LOGIT) for t, b in (self.logit_bias or {}).items()}
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, (list, tuple)) or not ids or not all(map(is_token_id, ids)):
                raise ValueError(f"allowed_token_ids must be a non-empty list of token ids, got {ids!r}")
            self.allowed_token_ids = [int(t) for t in ids]
        words = [] if self.bad_words is None else self.bad_words
        if not isinstance(words, (list, tuple)) or not all(is_text(w) and w.strip() for w in words):
            raise ValueError(f"bad_words must be a list of words (non-blank strings, valid Unicode), "
                             f"got {self.bad_words!r}")
        self.bad_words = list(words)
        for field in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
                      "spaces_between_special_tokens"):
            if not isinstance(getattr(self, field), bool):
                raise ValueError(f"{field} must be a bool, got {getattr(self, field)!r}")
        if (k := self.truncate_prompt_tokens) is not None and (not is_int(k) or not (k == -1 or k >= 1)):
            raise ValueError(f"truncate_prompt_tokens must be None, -1 (max_model_len) or an integer >= 1, got {k!r}")

    def clone(self) -> "SamplingParams":
        """A copy to change without touching this one (vLLM's)."""
        return copy.deepcopy(self)

    @property
    def penalizes(self) -> bool:
        """Whether a presence, frequency or repetition penalty is on: the sequence then counts its tokens."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)

    def sample_seed(self, index: int) -> int | None:
        """The seed of sample ``index``'s random stream: the request's own for the first sample, so
        ``n=1`` samples as it always did, and one derived from it for each other sample."""
        if self.seed is None or index == 0:
            return self.seed
        return hash((self.seed, index)) & 0x7FFF_FFFF_FFFF_FFFF


@dataclass
class BeamSearchParams:
    """Beam search (``LLM.beam_search``): keep the ``beam_width`` most likely continuations.

    A finished beam is ranked by its summed logprob over ``(generated tokens) ** length_penalty``,
    as HF transformers does: above 0 longer beams are favoured, below 0 shorter ones.
    ``include_stop_str_in_output`` keeps the EOS that ended a beam in its text. vLLM's fields, in its
    order; its ``temperature`` draws one more candidate per beam and step beside the most likely
    ones, which this search does not do, so it takes only the default, 0.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self):
        if not is_int(self.beam_width) or self.beam_width < 1:
            raise ValueError(f"beam_width must be an integer >= 1, got {self.beam_width!r}")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not is_number(self.length_penalty):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty!r}")
        if not (is_number(self.temperature) and self.temperature == 0):
            raise ValueError(f"temperature must be 0: beams are the most likely continuations, none is sampled "
                             f"(got {self.temperature!r})")
        for field in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, field), bool):
                raise ValueError(f"{field} must be a bool, got {getattr(self, field)!r}")
