"""Sampling metadata: where each row of a step's logits is (``LogitRows``) and what the sampler needs
to know about it (``SamplingMetadata``).

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


@dataclass
class LogitRows:
    """Where a step's rows are: in the logits the model returns, in the rows sampled from them, and
    in the output, which has a row per sample and a None row per sequence that samples nothing.

    The model returns, per sequence in order, a row for each prompt position that scores prompt
    logprobs, then, if the step reaches its end (``seq.is_sampling``), one for its next token and one
    more per speculative draft it brought (the drafts' positions are after the newest token's). A
    sequence's first sample draws all ``n`` of its request's samples from its one row. Worked
    example: A is a prompt chunk with more to come, scoring prompt logprobs at its positions 0..3;
    B is a prompt reaching its end, with ``n=2``; C decodes with 2 drafts. Then

        logits rows:   0 1 2 3 (A's prompt logprobs)   4 (B)   5 6 7 (C)
        prompt_logprobs = [range(0, 4), None, None]    sample_rows = [range(4, 5), range(5, 8)]
        repeats = [2, 1]
        sampled rows:  B's sample 0, B's sample 1, C    (rows 4, 4, 5 6 7)
        output:        [None, 0, 1, 2]    (A samples nothing; B's two samples; C's)
    """
    prompt_logprobs: list[range | None]  # per sequence: its prompt-logprob rows of the logits
    sample_rows: list[range]  # the logits rows of each sequence that samples
    repeats: list[int]  # how many samples each of those draws from its rows
    output: list[int | None]  # per output row: its sample, or None

    @classmethod
    def of(cls, prompt_logprob_rows: list[int | None], samples: list[int],
           drafts: list[int] | None = None) -> "LogitRows":
        """From each sequence's number of prompt-logprob rows (None: not asked), of samples it
        draws this step (0: none; ``n`` at a request's first sample) and of drafts it verifies."""
        rows, row, drawn = cls([], [], [], []), 0, 0
        for num_prompt_rows, num_samples, num_drafts in zip(prompt_logprob_rows, samples, drafts or [0] * len(samples)):
            rows.prompt_logprobs.append(None if num_prompt_rows is None else range(row, row + num_prompt_rows))
            row += num_prompt_rows or 0
            if not num_samples:
                rows.output.append(None)
                continue
            rows.sample_rows.append(range(row, row + 1 + num_drafts))
            rows.repeats.append(num_samples)
            rows.output += range(drawn, drawn + num_samples)
            row, drawn = row + 1 + num_drafts, drawn + num_samples
        return rows

    def sample_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The rows of logits each sample is drawn from, in order (a copy only where rows are skipped
        or repeated)."""
        index = [r for rows, n in zip(self.sample_rows, self.repeats) for _ in range(n) for r in rows]
        if index == list(range(len(logits))):
            return logits
        return logits[torch.tensor(index, device=logits.device)]

    def per_output(self, sampled: list) -> list:
        """The samples' values as output rows (None where a sequence sampled nothing)."""
        if self.output == list(range(len(sampled))):
            return sampled
        return [None if i is None else sampled[i] for i in self.output]
