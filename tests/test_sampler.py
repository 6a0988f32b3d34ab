"""The sampler: greedy, temperature, top-k, the top-p nucleus, and per-request seeds; each through
the torch ops and through the CPU kernel (cpu_sampler.cpp)."""

import pytest
import torch

from nanoengine.sampler import Sampler
from nanoengine.sampling_metadata import LogitRows
from nanoengine.sampling_params import SamplingParams


@pytest.fixture(params=[False, True], ids=["torch", "cpu_kernel"])
def sampler(request) -> Sampler:
    sampler = Sampler(cpu_kernel=request.param)
    if request.param and sampler.library is None:
        pytest.skip("no C++ compiler: the CPU kernel cannot be built")
    return sampler


def sample(sampler, logits, temperature=1.0, top_k=-1, top_p=1.0, seed=None, position=0):
    n = logits.shape[0]
    return sampler(logits, [temperature] * n, [top_k] * n, [top_p] * n, [seed] * n, [position] * n)


def test_greedy_takes_the_argmax(sampler):
    logits = torch.randn(8, 100)
    assert torch.equal(sample(sampler, logits, temperature=0), logits.argmax(-1))


def test_top_k_one_is_greedy_at_any_temperature(sampler):
    logits = torch.randn(8, 100)
    assert torch.equal(sample(sampler, logits, temperature=5.0, top_k=1), logits.argmax(-1))


def test_top_k_samples_only_the_k_most_likely(sampler):
    logits = torch.randn(1, 50).repeat(2000, 1)
    allowed = set(logits[0].topk(3).indices.tolist())
    assert set(sample(sampler, logits, top_k=3).tolist()) == allowed


def test_top_p_keeps_the_smallest_set_reaching_p(sampler):
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().repeat(4000, 1)
    # 0.5 < 0.7, 0.5 + 0.3 >= 0.7: the nucleus is the first two tokens.
    assert set(sample(sampler, logits, top_p=0.7).tolist()) == {0, 1}
    # exactly reaching p: 0.5 + 0.3 = 0.8 is enough, the third token stays out.
    assert set(sample(sampler, logits, top_p=0.8).tolist()) == {0, 1}
    # a tiny p still keeps the most likely token, even one that is 0 in float32
    assert set(sample(sampler, logits, top_p=1e-6).tolist()) == {0}
    assert set(sample(sampler, logits, top_p=1e-300).tolist()) == {0}


def test_top_k_zero_is_vllms_disabled():
    assert SamplingParams(top_k=0).top_k == -1 == SamplingParams().top_k


def brute_force_kept(logits: torch.Tensor, top_k: int, top_p: float) -> set[int]:
    """Sort the whole row: its top-k, then the most likely of those until their mass reaches p."""
    order = logits.argsort(descending=True)
    if top_k != -1:
        order = order[:top_k]
    probs = logits[order].softmax(-1)
    return set(order[(probs.cumsum(0) - probs) < top_p].tolist())


@pytest.mark.parametrize("vocab", [100, 5000])
@pytest.mark.parametrize("rows", [[0, 1, 2, 3, 4, 5], [1, 3, 4, 5]])  # with and without flat rows
def test_filters_keep_exactly_the_brute_force_sets_in_a_mixed_batch(vocab, rows):
    torch.manual_seed(0)
    # flat rows have a nucleus far wider than the sampler's 256-token shortlist, peaked ones a few tokens
    logits = (torch.randn(6, vocab) * torch.tensor([[0.1], [6.0], [0.1], [6.0], [1.0], [1.0]]))[rows]
    top_ks = [[-1, -1, 400, 20, -1, 7][r] for r in rows]
    top_ps = [[0.9, 0.9, 0.95, 0.5, 1.0, 1.0][r] for r in rows]
    filtered = Sampler._top_k_top_p(logits, top_ks, top_ps)
    for i in range(len(rows)):
        kept = set(filtered[i].isfinite().nonzero().flatten().tolist())
        assert kept == brute_force_kept(logits[i], top_ks[i], top_ps[i]), rows[i]


def test_sampling_frequencies_follow_the_distribution(sampler):
    probs = torch.tensor([0.6, 0.3, 0.1])
    counts = torch.bincount(sample(sampler, probs.log().repeat(20000, 1)), minlength=3) / 20000
    assert torch.allclose(counts, probs, atol=0.02)


def test_temperature_sharpens_the_distribution(sampler):
    logits = torch.tensor([[1.0, 0.0]]).repeat(5000, 1)
    hot = (sample(sampler, logits, temperature=2.0) == 0).float().mean()
    cold = (sample(sampler, logits, temperature=0.25) == 0).float().mean()
    assert cold > 0.95 and 0.55 < hot < 0.70  # softmax([0.5, 0]) = 0.62; softmax([4, 0]) = 0.98


def test_seeded_row_is_independent_of_the_rest_of_the_batch(sampler):
    torch.manual_seed(0)
    row = torch.randn(1, 1000)
    alone = sampler(row, [1.0], [-1], [1.0], [42], [7])
    batch = torch.cat([torch.randn(3, 1000), row, torch.randn(4, 1000)])
    together = sampler(batch, [1.0] * 8, [-1] * 8, [0.9, 1, 1, 1.0, 1, 1, 1, 1], [None, 1, None, 42, 5, None, 3, 2],
                       [0, 1, 2, 7, 4, 5, 6, 7])
    assert together[3] == alone[0]
    # a different position draws different noise: the same seed does not repeat one token forever
    draws = {int(sampler(torch.zeros(1, 1000), [1.0], [-1], [1.0], [42], [p])[0]) for p in range(20)}
    assert len(draws) > 10


@pytest.mark.parametrize("vocab", [300, 49152])  # a partial last chunk; SmolLM2's vocabulary
def test_two_level_inverse_cdf_picks_what_one_cumsum_picks(vocab):
    gen = torch.Generator().manual_seed(0)
    probs = torch.randn(64, vocab, generator=gen).mul(3).softmax(-1)
    probs[probs < probs.quantile(0.5, dim=-1, keepdim=True)] = 0  # filtered tokens: zero mass
    uniform = torch.rand(64, generator=gen)
    cdf = probs.cumsum(-1)
    expected = torch.searchsorted(cdf, uniform[:, None] * cdf[:, -1:], right=True).squeeze(1)
    assert torch.equal(Sampler.inverse_cdf(probs, uniform), expected)


def test_inverse_cdf_never_picks_a_token_of_zero_mass_at_the_extremes():
    probs = torch.zeros(4, 600)
    probs[:, 300:310] = 0.1  # mass only in the middle of the second chunk
    largest_below_one = torch.nextafter(torch.tensor(1.0), torch.tensor(0.0)).item()
    picked = Sampler.inverse_cdf(probs, torch.tensor([0.0, 1e-9, 1 - 1e-7, largest_below_one]))
    assert picked.tolist() == [300, 300, 309, 309]
    # A chunk's sum and the last entry of its cumsum round differently: u near 1 must still land
    # on a token of that chunk with mass, not past it.
    gen = torch.Generator().manual_seed(0)
    probs = torch.rand(256, 256, generator=gen) ** 4
    probs[:, 200:] = 0
    picked = Sampler.inverse_cdf(probs, torch.full((256,), largest_below_one))
    assert (picked < 200).all()


def cpu_kernel_sample(logits: torch.Tensor, temperatures: list[float], uniform: torch.Tensor) -> torch.Tensor:
    sampler = Sampler(cpu_kernel=True)
    if sampler.library is None:
        pytest.skip("no C++ compiler: the CPU kernel cannot be built")
    return sampler._sample_on_cpu(logits, temperatures, uniform)


@pytest.mark.parametrize("vocab", [7, 300, 49152])  # under a chunk; a partial last chunk; SmolLM2's
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernel_picks_the_token_whose_cdf_interval_holds_u(vocab, dtype):
    """Against float64: the softmax of logits / T, cumulated; the token picked is the one whose
    interval [cdf - p, cdf) holds u, up to float32's rounding of the sums; a -inf token never."""
    gen = torch.Generator().manual_seed(0)
    rows = 64
    logits = (torch.randn(rows, vocab, generator=gen) * 4).to(dtype)
    logits[torch.rand(rows, vocab, generator=gen) < 0.4] = float("-inf")  # cut by a filter
    logits[:, vocab // 2] = 1.0  # every row keeps a token
    temperatures = (0.2 + 1.5 * torch.rand(rows, generator=gen)).tolist()
    uniform = torch.rand(rows, generator=gen)
    picked = cpu_kernel_sample(logits, temperatures, uniform)[:, None]
    probs = (logits.double() / torch.tensor(temperatures, dtype=torch.float64)[:, None]).softmax(-1)
    cdf = probs.cumsum(-1)
    assert (probs.gather(1, picked) > 0).all()
    low, high = (cdf - probs).gather(1, picked).squeeze(1), cdf.gather(1, picked).squeeze(1)
    assert ((low - 1e-5 <= uniform) & (uniform < high + 1e-5)).all()
    # rows laid out apart (the logits of every other row) pick the same
    assert torch.equal(cpu_kernel_sample(torch.cat([logits, logits], 1)[:, :vocab], temperatures, uniform),
                       picked.squeeze(1))


def test_cpu_kernel_never_picks_a_token_of_zero_mass_at_the_extremes():
    logits = torch.full((4, 600), float("-inf"))
    logits[:, 300:310] = 2.0  # mass only in the middle of the second chunk
    largest_below_one = torch.nextafter(torch.tensor(1.0), torch.tensor(0.0)).item()
    picked = cpu_kernel_sample(logits, [0.7] * 4, torch.tensor([0.0, 1e-9, 1 - 1e-7, largest_below_one]))
    assert picked.tolist() == [300, 300, 309, 309]
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(256, 512, generator=gen) * 6
    logits[:, 200:256] = float("-inf")  # the first chunk's tail and all of the second's head but
    logits[:, 300:] = float("-inf")     # 256..299: u near 1 lands in the second chunk, on one of those
    picked = cpu_kernel_sample(logits, [1.0] * 256, torch.full((256,), largest_below_one))
    assert ((picked < 200) | ((256 <= picked) & (picked < 300))).all()
    assert logits.gather(1, picked[:, None]).isfinite().all()

def test_logit_rows_follow_the_worked_example():
    """LogitRows' docstring: A a prompt chunk scoring prompt logprobs at 4 positions, B's first sample
    with n=2, C a decode with 2 speculative drafts."""
    rows = LogitRows.of([4, None, None], [0, 2, 1], [0, 0, 2])
    assert rows.prompt_logprobs == [range(0, 4), None, None]
    assert (rows.sample_rows, rows.repeats, rows.output) == ([range(4, 5), range(5, 8)], [2, 1], [None, 0, 1, 2])
    logits = torch.arange(8.0)[:, None].expand(8, 3)
    assert rows.sample_logits(logits)[:, 0].tolist() == [4.0, 4.0, 5.0, 6.0, 7.0]
    assert rows.per_output(["b0", "b1", "c"]) == [None, "b0", "b1", "c"]


def test_logit_rows_of_a_plain_decode_step_copy_nothing():
    rows = LogitRows.of([None] * 3, [1] * 3)
    logits = torch.randn(3, 5)
    assert rows.sample_logits(logits) is logits and rows.per_output([7, 8, 9]) == [7, 8, 9]
