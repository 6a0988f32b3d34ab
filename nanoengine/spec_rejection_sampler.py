"""Verifying speculative drafts: which of them the target model would have produced itself.

A sample with ``d`` drafts (spec_decode.py) was scored at ``d + 1`` positions in one step: row
``j`` holds the target's logits for the token after the sample's tokens and its first ``j``
drafts. Draft ``j`` is checked against row ``j``; the first one refused ends the run, and the row
where the run ends gives one more token of the target's own. So a step emits between 1 and
``d + 1`` tokens per sample, and never a token the target would not have emitted:

- greedy rows accept a draft that is the row's argmax, and end with the argmax: token for token
  what decoding without drafts gives.
- sampled rows use rejection sampling (Leviathan et al. 2023; Chen et al. 2023). A proposer here
  is deterministic: it puts all its probability on its draft ``x``, so ``q(x) = 1`` and the
  acceptance test ``u < min(1, p(x) / q(x))`` is ``u < p(x)``; a refused draft is replaced by a
  sample from the residual ``max(0, p - q)``, which is ``p`` with ``x`` taken out. Then
  ``P(x) = p(x)`` and ``P(y) = (1 - p(x)) p(y) / (1 - p(x)) = p(y)`` for any other ``y``: the
  output follows the target's distribution exactly, after its logits processors, temperature,
  min-p, top-k and top-p, which each row applies with the drafts before it in its history.

Seeded rows draw both numbers from generators keyed by the seed and the position they decide
(the acceptance test as a second draw), so a seeded request gives the same tokens again.
"""

import torch

from nanoengine.logits_processors import LogitsProcessors, apply_logits_processors
from nanoengine.sampler import Sampler


class RejectionSampler:
    def __init__(self, sampler: Sampler):
        self.sampler = sampler

    def __call__(self, logits: torch.Tensor, draft_token_ids: list[list[int]], temperatures: list[float],
                 top_ks: list[int], top_ps: list[float], seeds: list[int | None], positions: list[int],
                 min_ps: list[float] | None = None,
                 processors: LogitsProcessors | None = None) -> tuple[list[list[int]], torch.Tensor]:
        """Per sample, its new tokens: the accepted drafts and one token after them. ``logits`` has
        ``len(drafts) + 1`` rows per sample, in order, and the other arguments a value per row.
        Also returns the token each row stands for (a row past the run's end keeps its draft), for
        the logprobs of what was emitted."""
        device = logits.device
        logits = apply_logits_processors(logits, processors)
        greedy = logits.argmax(dim=-1)
        # Row r's draft (the token it checks), and -1 on each sample's last row, which checks none.
        drafts = torch.tensor([t for d in draft_token_ids for t in d + [-1]], device=device)
        has_draft = drafts >= 0
        draft = drafts.clamp_min(0)
        sampled_rows = torch.tensor(temperatures, device=device) > 0
        accepted = has_draft & (greedy == draft)
        probs = None
        if bool(sampled_rows.any()):
            probs = self.sampler.probs(logits, temperatures, top_ks, top_ps, min_ps)
            passes = self.sampler.uniform(seeds, positions, device, draw=1) < probs.gather(1, draft[:, None]).squeeze(1)
            accepted = torch.where(sampled_rows, has_draft & passes, accepted)
        # Each sample's run: its drafts up to the first refused one; its last row ends it anyway.
        accepted, starts, ends, row = accepted.tolist(), [], [], 0
        for d in draft_token_ids:
            starts.append(row)
            ends.append(row + next((j for j in range(len(d)) if not accepted[row + j]), len(d)))
            row += len(d) + 1
        end_rows = torch.tensor(ends, device=device)
        final = greedy[end_rows]
        if probs is not None:
            # The residual: the refused draft taken out (nothing to take out where all drafts passed).
            residual = probs[end_rows].scatter(1, draft[end_rows, None], 0.0)
            residual = torch.where(has_draft[end_rows, None], residual, probs[end_rows])
            # A draft refused though it held all the mass (u just under a rounded 1.0) leaves nothing:
            # it stands, as it would have with exact arithmetic.
            empty = residual.sum(-1, keepdim=True) == 0
            residual = torch.where(empty, probs[end_rows], residual)
            uniform = self.sampler.uniform([seeds[r] for r in ends], [positions[r] for r in ends], device)
            final = torch.where(sampled_rows[end_rows], self.sampler.inverse_cdf(residual, uniform), final)
        final = final.tolist()
        tokens = [d[:end - first] + [token] for d, first, end, token in zip(draft_token_ids, starts, ends, final)]
        chosen = draft.clone()
        chosen[end_rows] = torch.tensor(final, device=device)
        return tokens, chosen

