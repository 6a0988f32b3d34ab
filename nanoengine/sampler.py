"""Turning the last position's logits into the next token of every sequence in the batch.

Greedy rows (temperature 0) take the argmax. The others are scaled by their temperature, cut
to their top-k, then to their nucleus (the smallest set of most likely tokens whose probability
reaches top_p; the most likely token always stays), and sampled with the exponential race:
``argmax(p / E)`` with ``E ~ Exp(1)`` picks token i with probability p_i, with no cumsum search.
A seeded row draws its noise from its own generator, keyed by the seed and the token's
position, so it samples the same tokens whatever else is in the batch, and again after a
preemption's recompute.
"""

import torch


class Sampler:
    def __call__(self, logits: torch.Tensor, temperatures: list[float], top_ks: list[int],
                 top_ps: list[float], seeds: list[int | None], positions: list[int]) -> torch.Tensor:
        logits = logits.float()
        greedy = logits.argmax(dim=-1)
        if all(t == 0 for t in temperatures):
            return greedy
        device = logits.device
        temps = torch.tensor(temperatures, device=device)
        logits = logits / temps.clamp_min(1e-6)[:, None]
        if any(k != -1 for k in top_ks) or any(p < 1 for p in top_ps):
            logits = self._top_k_top_p(logits, top_ks, top_ps)
        probs = logits.softmax(dim=-1)
        noise = torch.empty_like(probs).exponential_()
        for row, seed in enumerate(seeds):
            if seed is not None:
                gen = torch.Generator().manual_seed(hash((seed, positions[row])) & 0x7FFF_FFFF_FFFF_FFFF)
                noise[row] = torch.empty(probs.shape[1]).exponential_(generator=gen).to(device)
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(temps == 0, greedy, sampled)

    @staticmethod
    def _top_k_top_p(logits: torch.Tensor, top_ks: list[int], top_ps: list[float]) -> torch.Tensor:
        vocab = logits.shape[-1]
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ks = torch.tensor([k if k != -1 else vocab for k in top_ks], device=logits.device)
        ranks = torch.arange(vocab, device=logits.device)
        sorted_logits = sorted_logits.masked_fill(ranks >= ks[:, None], float("-inf"))
        probs = sorted_logits.softmax(dim=-1)
        # Keep token i while the tokens ranked above it hold less than top_p of the mass.
        mass_before = probs.cumsum(dim=-1) - probs
        ps = torch.tensor(top_ps, device=logits.device)
        drop = (mass_before >= ps[:, None]) & (ps[:, None] < 1)
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
