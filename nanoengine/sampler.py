"""Turning the last position's logits into the next token of every sequence in the batch.

Greedy rows (temperature 0) take the argmax. The others are scaled by their temperature, cut
to their top-k, then to their nucleus (the smallest set of most likely tokens whose probability
reaches top_p; the most likely token always stays), and sampled by inverting the cumulative
distribution with one uniform number per row. (Drawing a noise value per vocabulary entry, as
the exponential-race trick does, costs more than the whole decode matmul budget on a CPU.)
A seeded row draws its number from its own generator, keyed by the seed and the token's
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
        cdf = logits.softmax(dim=-1).cumsum_(dim=-1)
        uniform = torch.rand(len(seeds))
        for row, seed in enumerate(seeds):
            if seed is not None:
                gen = torch.Generator().manual_seed(hash((seed, positions[row])) & 0x7FFF_FFFF_FFFF_FFFF)
                uniform[row] = torch.rand(1, generator=gen)
        # Token i is picked when cdf[i-1] <= u < cdf[i]: a filtered token (zero mass) never is.
        total = cdf[:, -1:]
        u = torch.minimum(uniform.to(device)[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
        sampled = torch.searchsorted(cdf, u, right=True).squeeze(1)
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
