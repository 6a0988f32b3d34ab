"""Speculative decoding: guess a sequence's next few tokens cheaply, so one model step can check them all.

A batch-1 decode step streams every weight of the model to compute one token; the compute units
mostly wait. A step that computes ``k + 1`` positions streams the same weights once, so if
something cheap can *propose* the next ``k`` tokens, the target model scores them all in one step
(a prefill-shaped step: the newest token and the drafts after it) and keeps the ones it would have
produced itself (spec_rejection_sampler.py). Every accepted draft is a token for free; a rejected one
costs only its share of that step's compute.

This module is the configuration and the proposer interface, with the cheapest proposer:
n-gram prompt lookup, which needs no second model. Text that repeats, edits or quotes its prompt
(code edits, summaries with citations, "say it again, but...") is full of runs the model will
copy, and the end of the sequence so far says where it is in such a run. The draft-model proposer
(spec_draft_model.py) runs a small model of the same tokenizer instead.

Where the drafts go (vLLM V1's flow): after each step the engine asks the proposer for the
running sequences' drafts (``seq.spec_token_ids``); the scheduler gives each sequence that many
lookahead slots beyond its newest token; the model runner computes them with the prefill path;
the rejection sampler accepts a prefix; ``Scheduler.postprocess`` appends the accepted tokens and
takes the rejected positions back out of the cache.
"""

from array import array
from dataclasses import dataclass
from typing import Protocol

from nanoengine.sampling_params import is_int

METHODS = ("ngram", "draft_model")


@dataclass
class SpeculativeConfig:
    """``LLM(speculative_config={...})``, in vLLM's names.

    ``num_speculative_tokens``: at most this many drafts per sequence and step. For "ngram",
    ``prompt_lookup_max`` and ``prompt_lookup_min``: the longest and shortest suffix of the
    sequence looked for earlier in it (either defaults to the other; both to 5, as in vLLM).
    For "draft_model", ``model``: the draft's checkpoint (same tokenizer as the target).
    ``disable_by_batch_size``: no drafts once this many sequences run (None: never). Such a step
    is compute-bound, and the drafts' extra positions cost more than the steps they save: on 2
    CPU cores, bench.py's 64 requests ran at 0.95-0.97x with drafts at every batch size, and at
    1.00x with none from 32 sequences up (while the run's tail still drafted). Hence 32.
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    model: str | None = None
    disable_by_batch_size: int | None = 32

    @classmethod
    def from_dict(cls, options: dict) -> "SpeculativeConfig":
        if isinstance(options, SpeculativeConfig):
            return options
        if not isinstance(options, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(options).__name__}")
        known = set(cls.__dataclass_fields__)
        if unknown := sorted(set(options) - known):
            raise ValueError(f"speculative_config has unknown key(s) {unknown}; valid keys are {sorted(known)}")
        if missing := sorted({"method", "num_speculative_tokens"} - set(options)):
            raise ValueError(f"speculative_config needs {missing}")
        return cls(**options)

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {list(METHODS)}, got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < 1):
                raise ValueError(f"speculative_config.{name} must be a positive integer, got {value!r}")
        if self.method == "ngram":
            if self.model is not None:
                raise ValueError("speculative_config.model is for method 'draft_model'; 'ngram' needs no model")
            self.prompt_lookup_max = self.prompt_lookup_max or self.prompt_lookup_min or 5
            self.prompt_lookup_min = self.prompt_lookup_min or self.prompt_lookup_max
            if self.prompt_lookup_min > self.prompt_lookup_max:
                raise ValueError(f"speculative_config.prompt_lookup_min={self.prompt_lookup_min} is more than "
                                 f"prompt_lookup_max={self.prompt_lookup_max}")
        else:
            if not isinstance(self.model, str):
                raise ValueError("speculative_config.model (the draft's checkpoint) is needed for 'draft_model'")
            if self.prompt_lookup_max is not None or self.prompt_lookup_min is not None:
                raise ValueError("speculative_config.prompt_lookup_max/min are for method 'ngram'")


class Proposer(Protocol):
    """Drafts for a batch of sequences: at most ``max_drafts[i]`` tokens to follow sequence ``i``'s
    tokens, fewer or none where it has no good guess. A proposer keeps no promise about quality;
    the rejection sampler keeps the one about correctness."""

    def propose(self, seqs: list, max_drafts: list[int]) -> list[list[int]]: ...


class NgramProposer:
    """Prompt lookup: the longest suffix of the sequence (``prompt_lookup_max`` tokens down to
    ``prompt_lookup_min``) that occurred earlier in it proposes the tokens that followed there.
    The most recent earlier occurrence wins: the nearer the context, the likelier it continues alike.
    """

    def __init__(self, config: SpeculativeConfig):
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, seqs: list, max_drafts: list[int]) -> list[list[int]]:
        return [self.lookup(seq.token_ids, k) if k > 0 else [] for seq, k in zip(seqs, max_drafts)]

    def lookup(self, token_ids: list[int], k: int) -> list[int]:
        # Searched as bytes, four per token, with bytes.rfind: C speed (a Python loop over a 2,000
        # token history took longer than a decode step). A hit must start on a token's boundary.
        history = array("i", token_ids).tobytes()
        for n in range(min(self.max_n, len(token_ids) - 1), self.min_n - 1, -1):
            suffix, end = history[-4 * n:], len(history) - 4  # an occurrence must end before the last token
            while (at := history.rfind(suffix, 0, end)) != -1 and at % 4:
                end = at + 4 * n - 1  # misaligned: look again, strictly before this hit
            if at != -1:
                start = at // 4 + n
                return token_ids[start:start + k]
        return []
