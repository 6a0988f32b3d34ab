"""Beam search's bookkeeping for one prompt, step by step, as HF transformers keeps it.

``LLM.beam_search`` drives it on top of the engine, as vLLM's own ``LLM.beam_search`` does: at each
step every live beam is a request for one token with its top logprobs, and ``BeamSearch.step``
picks the next beams from them. The beams' prompts differ only in their last few tokens, so the
prefix cache serves their common blocks, shared by reference count, and a step computes only each
beam's tokens since its last full block. (Forking beams inside the engine would save that
recompute, at the price of a second, beam-shaped path through the scheduler.)

The rules are those of HF's ``generate(num_beams=W, do_sample=False, early_stopping=False)``:
each step ranks the ``K = max(2, 1 + number of EOS ids) * W`` best one-token continuations of all
live beams by summed logprob. Those among the first ``W`` that end in EOS, or reach
``max_tokens``, are finished, scored ``sum / generated_tokens ** length_penalty``, and the best
``W`` finished ones are kept; the ``W`` best that did not finish live on. The search ends when
every continuation finished, or once ``W`` beams are finished and the best live beam, scored at
its current length, is no better than the worst of them.
"""

from dataclasses import dataclass

from nanoengine.sampling_params import BeamSearchParams


@dataclass
class Beam:
    token_ids: list[int]  # generated so far
    cumulative_logprob: float


class BeamSearch:
    def __init__(self, params: BeamSearchParams, eos_token_ids: set[int]):
        self.params = params
        self.eos_token_ids = set() if params.ignore_eos else eos_token_ids
        self.num_candidates = max(2, 1 + len(self.eos_token_ids)) * params.beam_width
        self.running = [Beam([], 0.0)]  # the beams start as one: the prompt
        self.finished: list[tuple[float, Beam]] = []  # (score, beam), best first
        self.done = False

    def step(self, logprobs: list[dict[int, float]]) -> None:
        """Advance by one token, given each running beam's ``num_candidates`` most likely next tokens."""
        width, penalty = self.params.beam_width, self.params.length_penalty
        num_generated = len(self.running[0].token_ids) + 1
        candidates = sorted(((beam.cumulative_logprob + lp, beam, token)
                             for beam, top in zip(self.running, logprobs) for token, lp in top.items()),
                            key=lambda c: c[0], reverse=True)[:self.num_candidates]
        at_length = num_generated >= self.params.max_tokens
        ends = [at_length or token in self.eos_token_ids for _, _, token in candidates]
        for (total, beam, token), end in zip(candidates[:width], ends):  # only the first W may finish
            if end:
                self.finished.append((total / num_generated ** penalty, Beam(beam.token_ids + [token], total)))
        self.finished = sorted(self.finished, key=lambda f: f[0], reverse=True)[:width]
        self.running = [Beam(beam.token_ids + [token], total)
                        for (total, beam, token), end in zip(candidates, ends) if not end][:width]
        best_running = self.running[0].cumulative_logprob / num_generated ** penalty if self.running else None
        self.done = (best_running is None or len(self.finished) == width and best_running <= self.finished[-1][0])

    def best(self) -> list[Beam]:
        return [beam for _, beam in self.finished]
