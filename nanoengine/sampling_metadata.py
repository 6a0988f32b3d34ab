"""Sampling metadata: what the sampler needs to know about each row of a step's logits.

The model runner hands the sampler a row of logits per position it must decide: one per sample,
or for a sample with speculative drafts one per draft and one after them. ``SamplingMetadata``
lists each row's parameters (temperature, top-k, top-p, min-p, seed, position) and builds its
logits processors from the row's history: row ``j`` of a sample with drafts follows the sample's
tokens *and its first j drafts*, which its penalties, ``min_tokens`` and seed position see as
sampled already, so a draft is judged exactly as the token would be in plain decoding.
"""

from dataclasses import dataclass
from itertools import accumulate

import torch

from nanoengine.logits_processors import LogitsProcessors, build_logits_processors, restrict
from nanoengine.sampler import compute_logprobs
from nanoengine.sequence import Sequence
from nanoengine.structured_output import allowed_tokens


@dataclass
class SamplingMetadata:
    draft_token_ids: list[list[int]]  # per sample: the drafts it verifies (none, mostly)
    num_logprobs: list[int | None]  # per row, from here on
    temperatures: list[float]
    top_ks: list[int]
    top_ps: list[float]
    seeds: list[int | None]
    positions: list[int]  # of the token each row decides
    min_ps: list[float]
    processors: LogitsProcessors | None

    @classmethod
    def of(cls, seqs: list[Sequence], eos_token_ids: set[int], vocab_size: int,
           device: torch.device) -> "SamplingMetadata":
        """The rows of ``seqs``' samples, each sequence's ``sample_indices`` in turn (at a request's
        first sample, its n rows share the empty completion)."""
        samples = [(seq, index) for seq in seqs for index in seq.sample_indices]
        rows = [(seq, index, seq.token_ids + seq.spec_token_ids[:j] if j else seq.token_ids)
                for seq, index in samples for j in range(1 + len(seq.spec_token_ids))]
        params = [seq.sampling_params for seq, _, _ in rows]
        # A constrained sample never has drafts (the engine proposes none for it), so its grammar
        # scores its one row.
        processors = build_logits_processors(
            [(p, tokens, seq.num_prompt_tokens, _counts(seq.output_token_counts, tokens[seq.num_tokens:]),
              seq.bad_words_token_ids) for p, (seq, _, tokens) in zip(params, rows)],
            eos_token_ids, device, restrict(allowed_tokens([seq.grammar for seq, _, _ in rows], vocab_size),
                                            [seq.allowed_token_mask for seq, _, _ in rows], device))
        return cls([seq.spec_token_ids for seq, _ in samples], [p.logprobs for p in params],
                   [p.temperature for p in params], [p.top_k for p in params], [p.top_p for p in params],
                   [p.sample_seed(i) for p, (_, i, _) in zip(params, rows)], [len(tokens) for _, _, tokens in rows],
                   [p.min_p for p in params], processors)

    @property
    def has_drafts(self) -> bool:
        return any(self.draft_token_ids)

    @property
    def sampler_args(self) -> tuple:
        """The rows' parameters in the order ``Sampler`` and ``RejectionSampler`` take them."""
        return (self.temperatures, self.top_ks, self.top_ps, self.seeds, self.positions, self.min_ps, self.processors)

    def emitted_logprobs(self, logits: torch.Tensor, chosen: torch.Tensor,
                         token_ids: list[list[int]]) -> list[list[dict[int, float]] | None] | None:
        """Per sample, the logprobs of the tokens it emitted, each from its own row (``chosen``: the
        token each row stands for); None when no row asks."""
        if all(k is None for k in self.num_logprobs):
            return None
        per_row = compute_logprobs(logits, chosen, self.num_logprobs)
        starts = accumulate((1 + len(d) for d in self.draft_token_ids), initial=0)
        return [None if per_row[start] is None else per_row[start:start + len(tokens)]
                for start, tokens in zip(starts, token_ids)]


def _counts(counts: dict[int, int] | None, drafts: list[int]) -> dict[int, int] | None:
    """A completion's token counts (kept only when a penalty needs them), with ``drafts`` added."""
    if counts is None or not drafts:
        return counts
    counts = dict(counts)
    for token_id in drafts:
        counts[token_id] = counts.get(token_id, 0) + 1
    return counts
