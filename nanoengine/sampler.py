"""Turning the last position's logits into the next token of every sequence in the batch.

First each row's logits processors (logit bias, min_tokens, penalties: logits_processors.py).
Then greedy rows (temperature 0) take the argmax. The others are scaled by their temperature,
cut to their min-p, their top-k, then their nucleus (the smallest set of most likely tokens
whose probability reaches top_p; the most likely token always stays), and sampled by inverting
the cumulative distribution with one uniform number per row. (Drawing a noise value per
vocabulary entry, as the exponential-race trick does, costs more than the whole decode matmul
budget on a CPU.) On CPU the temperature, softmax and inversion are one C++ pass a row
(cpu_sampler.cpp) when no filter applies, and follow the filters' cut logits when one does.
A seeded row draws its number from its own generator, keyed by the seed and the token's
position, so it samples the same tokens whatever else is in the batch, and again after a
preemption's recompute.

Logprobs, when a sequence asks for them, are the log-softmax of the raw logits (before the
logits processors, temperature, min-p, top-k and top-p, as vLLM returns them), computed only for
the rows that ask, so a batch where none does pays nothing.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nanoengine.cpu_kernels import DTYPES
from nanoengine.cpu_library import load
from nanoengine.logits_processors import LogitsProcessors, apply_logits_processors

SAMPLER_CHUNK = 256  # tokens per chunk of the two-level inverse CDF


def _below(x: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """x, but strictly below total (the largest float under it where x is not)."""
    return torch.minimum(x, torch.nextafter(total, torch.zeros_like(total)))


@dataclass
class SamplerOutput:
    """A step's samples: a row per sample (each sequence's ``sample_indices`` in turn), holding its
    new tokens: one, or with speculative drafts the accepted ones and the one after."""

    token_ids: list[list[int]]
    logprobs: list[list[dict[int, float]] | None] | None = None  # per row, per token; None when no row asked
    # Per sequence: its prompt tokens' logprobs from this step's positions; None when none asked.
    prompt_logprobs: list[list[dict[int, float]] | None] | None = None
    # A pooling runner's, in place of tokens (pooler.py): per sequence, its pooled state or its vector.
    pooled: list[torch.Tensor] | None = None


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor,
                     num_logprobs: list[int | None]) -> list[dict[int, float] | None]:
    """Per row: ``{token_id: logprob}`` with the row's token and its ``num_logprobs`` most likely
    ones (the token comes first); None for a row whose ``num_logprobs`` is None."""
    rows = [i for i, k in enumerate(num_logprobs) if k is not None]
    if not rows:
        return [None] * len(num_logprobs)
    index = torch.tensor(rows, device=logits.device)
    logprobs = logits.index_select(0, index).float().log_softmax(dim=-1)
    chosen = token_ids.index_select(0, index)
    chosen_logprob = logprobs.gather(1, chosen[:, None]).squeeze(1).tolist()
    top_logprob, top_id = logprobs.topk(max(num_logprobs[i] for i in rows), dim=-1)
    out: list[dict[int, float] | None] = [None] * len(num_logprobs)
    for row, token, lp, top_ids, top_lps in zip(rows, chosen.tolist(), chosen_logprob, top_id.tolist(),
                                                top_logprob.tolist()):
        k = num_logprobs[row]
        out[row] = {token: lp, **{t: v for t, v in zip(top_ids[:k], top_lps[:k]) if t != token}}
    return out


class Sampler:
    """``cpu_kernel``: sample CPU logits through cpu_sampler.cpp (softmax and inverse CDF in one
    pass a row) where it builds; else, and in learner mode, through the torch ops below. With the
    engine's ``seed``, unseeded rows draw from a generator of its own, started from that seed, so
    that neither other engines in the process nor the user's code move its draws; without, from
    torch's global one."""

    def __init__(self, cpu_kernel: bool = False, seed: int | None = None):
        self.library = load("cpu_sampler.cpp") if cpu_kernel else None
        self.generator = None if seed is None else torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, temperatures: list[float], top_ks: list[int],
                 top_ps: list[float], seeds: list[int | None], positions: list[int],
                 min_ps: list[float] | None = None, processors: LogitsProcessors | None = None) -> torch.Tensor:
        logits = apply_logits_processors(logits, processors)
        if all(t == 0 for t in temperatures):
            return logits.argmax(dim=-1)
        greedy = logits.argmax(dim=-1) if any(t == 0 for t in temperatures) else None
        uniform = self.uniform(seeds, positions, logits.device)
        if self.library is None or logits.device.type != "cpu" or logits.dtype not in DTYPES:
            sampled = self.inverse_cdf(self.probs(logits, temperatures, top_ks, top_ps, min_ps), uniform)
        elif self._filters(top_ks, top_ps, min_ps):  # the filters cut the scaled logits: sample those as they are
            sampled = self._sample_on_cpu(self.scaled_logits(logits, temperatures, top_ks, top_ps, min_ps),
                                          [1.0] * len(temperatures), uniform)
        else:
            sampled = self._sample_on_cpu(logits, temperatures, uniform)
        if greedy is None:
            return sampled
        return torch.where(torch.tensor([t == 0 for t in temperatures], device=logits.device), greedy, sampled)

    def probs(self, logits: torch.Tensor, temperatures: list[float], top_ks: list[int], top_ps: list[float],
              min_ps: list[float] | None = None) -> torch.Tensor:
        """The distribution each row samples from. (A greedy row's is meaningless: it takes the argmax.)"""
        return self.scaled_logits(logits, temperatures, top_ks, top_ps, min_ps).softmax(dim=-1)

    def scaled_logits(self, logits: torch.Tensor, temperatures: list[float], top_ks: list[int],
                      top_ps: list[float], min_ps: list[float] | None = None) -> torch.Tensor:
        """Float32: each row's processed logits scaled by its temperature, then -inf outside its
        min-p, top-k and top-p."""
        temps = torch.tensor(temperatures, device=logits.device)
        logits = logits / temps.clamp_min(1e-6)[:, None]
        if min_ps is not None and any(p > 0 for p in min_ps):
            logits = self._min_p(logits, min_ps)
        if any(k != -1 for k in top_ks) or any(p < 1 for p in top_ps):
            logits = self._top_k_top_p(logits, top_ks, top_ps)
        return logits

    @staticmethod
    def _filters(top_ks: list[int], top_ps: list[float], min_ps: list[float] | None) -> bool:
        """Whether any row is cut to its top-k, top-p or min-p."""
        return any(k != -1 for k in top_ks) or any(p < 1 for p in top_ps) or any(p > 0 for p in min_ps or [])

    def _sample_on_cpu(self, logits: torch.Tensor, temperatures: list[float], uniform: torch.Tensor) -> torch.Tensor:
        """cpu_sampler.cpp: the temperature, the softmax and ``inverse_cdf`` in one read of each row
        (and of one chunk again), where torch makes five passes over the batch's logits. A call in
        bench.py's decode steps (batch 41, 49,152 tokens), alternating in one process: 3.6-4.4 ->
        0.8-1.2 ms."""
        logits = logits if logits.stride(-1) == 1 else logits.contiguous()
        temps = torch.tensor(temperatures, dtype=torch.float32).clamp_min(1e-6)
        tokens = torch.empty(len(logits), dtype=torch.int64)
        getattr(self.library, f"sample_{DTYPES[logits.dtype]}")(
            logits.data_ptr(), logits.stride(0), len(logits), logits.shape[-1], temps.data_ptr(), uniform.data_ptr(),
            tokens.data_ptr(), torch.get_num_threads())
        return tokens

    def uniform(self, seeds: list[int | None], positions: list[int], device: torch.device,
                draw: int = 0) -> torch.Tensor:
        """One uniform number per row: an unseeded row's from the engine's generator, a seeded row's
        from a generator keyed by its seed, the position of the token it decides and which ``draw``
        this is at that position."""
        uniform = torch.rand(len(seeds), generator=self.generator)
        for row, seed in enumerate(seeds):
            if seed is not None:
                key = (seed, positions[row]) if draw == 0 else (seed, positions[row], draw)
                gen = torch.Generator().manual_seed(hash(key) & 0x7FFF_FFFF_FFFF_FFFF)
                uniform[row] = torch.rand(1, generator=gen)
        return uniform.to(device)

    @staticmethod
    def inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
        """Token i of each row such that cdf[i-1] <= u * total < cdf[i], found in two levels.

        One cumsum over the whole vocabulary is a serial chain of additions per row: 2.2 ms at
        batch 64 here, for 49k tokens. Sums of chunks of 256 tokens vectorise, so a row first
        finds its chunk in the cumsum of its chunk sums, then its token in that one chunk's
        cumsum. u is kept below the total at each level, so a token of zero mass (filtered out)
        is never picked.
        """
        rows, vocab = probs.shape
        pad = -vocab % SAMPLER_CHUNK  # zeros: no mass
        chunks = (F.pad(probs, (0, pad)) if pad else probs).view(rows, -1, SAMPLER_CHUNK)
        chunk_cdf = chunks.sum(-1).cumsum(-1)
        target = _below(uniform[:, None] * chunk_cdf[:, -1:], chunk_cdf[:, -1:])
        chunk = torch.searchsorted(chunk_cdf, target, right=True)  # [rows, 1]
        before = chunk_cdf.gather(-1, (chunk - 1).clamp_min(0)).masked_fill(chunk == 0, 0)
        token_cdf = chunks.gather(1, chunk[:, :, None].expand(-1, -1, SAMPLER_CHUNK)).squeeze(1).cumsum(-1)
        token = torch.searchsorted(token_cdf, _below(target - before, token_cdf[:, -1:]), right=True)
        return (chunk * SAMPLER_CHUNK + token).squeeze(1)

    @staticmethod
    def _min_p(logits: torch.Tensor, min_ps: list[float]) -> torch.Tensor:
        """Set to -inf every token less likely than its row's min_p times the most likely one, as HF's
        ``MinPLogitsWarper`` does; after temperature, so the cut follows the distribution sampled."""
        probs = logits.softmax(dim=-1)
        threshold = torch.tensor(min_ps, device=logits.device)[:, None] * probs.amax(dim=-1, keepdim=True)
        return logits.masked_fill(probs < threshold, float("-inf"))

    @staticmethod
    def _top_k_top_p(logits: torch.Tensor, top_ks: list[int], top_ps: list[float]) -> torch.Tensor:
        """Set every logit outside its row's top-k, then outside its nucleus, to -inf.

        Both cuts are thresholds on value, as in HF (a token tied with the last one kept stays).
        Finding them needs only the head of each row's ranking: sorting all 49k logits of 64 rows
        takes ~120 ms on 2 cores, ``topk`` of the first 256 about 5 ms. So the nucleus is looked
        for in such a shortlist, and in the whole sorted vocabulary only in a batch where some
        row's shortlist holds less than its top_p of the probability mass.
        """
        vocab, device = logits.shape[-1], logits.device
        if any(k != -1 for k in top_ks):
            head = logits.topk(min(max(top_ks), vocab), dim=-1).values
            kth = head.gather(-1, torch.tensor([[min(k, vocab) - 1 if k != -1 else 0] for k in top_ks], device=device))
            kth = kth.masked_fill(torch.tensor([[k == -1] for k in top_ks], device=device), float("-inf"))
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if any(p < 1 for p in top_ps):
            ps = torch.tensor(top_ps, device=device)[:, None]
            probs = logits.softmax(dim=-1)
            head = probs.topk(min(256, vocab), dim=-1).values
            if bool(((head.sum(-1, keepdim=True) < ps) & (ps < 1)).any()):
                head = probs.sort(dim=-1, descending=True).values
            # The token at rank r stays while the tokens ranked above it hold less than top_p
            # (so the most likely token always stays); rows with top_p = 1 keep everything.
            # (clamped: a top_p below float32's smallest, 1e-46, is 0 here and would keep none)
            num_kept = ((head.cumsum(dim=-1) - head) < ps).sum(-1, keepdim=True).clamp_min(1)
            threshold = head.gather(-1, num_kept - 1).masked_fill(ps >= 1, 0)
            logits = logits.masked_fill(probs < threshold, float("-inf"))
        return logits
