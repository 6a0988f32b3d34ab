"""Logits processors: what a request changes in its logits before the sampler picks a token.

In vLLM's order (its V1 sampler's): ``logit_bias`` is added and ``min_tokens`` holds the stop
tokens back (-inf), then the penalties: HF's repetition penalty over the prompt and the completion
(a positive logit divided by it, a negative one multiplied), then OpenAI's presence and frequency
penalties over the completion only, ``logit -= frequency_penalty * count + presence_penalty *
(count > 0)``. Greedy rows take the argmax of the result; temperature, min-p, top-k and top-p
follow in the sampler. Logprobs are read from the raw logits, which are left as they were.

Each processor changes only a few tokens of a row (its biased tokens, its stop tokens, the tokens
it has seen), so a step's processing is a list of (row, token id) entries flattened over the whole
batch, applied with one gather and one scatter per kind, never a pass over the vocabulary, and
never a loop over rows on the device. A step in which no row uses any of them builds nothing
(``build_logits_processors`` returns None) and skips the pass.

``apply_logits_processors`` is the one seam: a grammar's bitmask is one more kind of entry
applied there, and a speculative verifier applies the same processing to its draft positions by
building rows whose tokens include the drafts before them.
"""

from dataclasses import dataclass

import torch

from nanoengine.sampling_params import SamplingParams

# Per row: its parameters, its token ids (prompt, then completion), the prompt's length, and how
# often each token occurs in the completion (None unless a penalty is on).
Row = tuple[SamplingParams, list[int], int, dict[int, int] | None]


@dataclass
class LogitsProcessors:
    """A step's processing as (rows, token ids, values) entries; a kind that no row uses is None."""

    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # added: logit_bias, or -inf (min_tokens)
    repetition: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # each seen token's penalty
    occurrences: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # subtracted: presence and frequency


def build_logits_processors(rows: list[Row], eos_token_ids: set[int],
                            device: torch.device) -> LogitsProcessors | None:
    """The entries of a batch's rows, or None when no row asks for any processing."""
    bias: tuple[list, list, list] = ([], [], [])
    repetition: tuple[list, list, list] = ([], [], [])
    counted: tuple[list, list, list, list, list] = ([], [], [], [], [])  # rows, ids, counts, presence, frequency
    for row, (params, token_ids, num_prompt_tokens, counts) in enumerate(rows):
        if params.logit_bias:
            _extend(bias, row, params.logit_bias.keys(), params.logit_bias.values())
        if len(token_ids) - num_prompt_tokens < params.min_tokens:
            held_back = set(params.stop_token_ids) | (set() if params.ignore_eos else eos_token_ids)
            _extend(bias, row, held_back, [float("-inf")] * len(held_back))
        if params.repetition_penalty != 1:
            # A token both in the prompt and the completion is two entries; both write the same value.
            seen = token_ids[:num_prompt_tokens] + list(counts)
            _extend(repetition, row, seen, [params.repetition_penalty] * len(seen))
        if params.presence_penalty or params.frequency_penalty:
            _extend(counted, row, counts.keys(), counts.values(), [params.presence_penalty] * len(counts),
                    [params.frequency_penalty] * len(counts))
    if not (bias[0] or repetition[0] or counted[0]):
        return None
    occurrences = None
    if counted[0]:
        rows_, token_ids, count, presence, frequency = _tensors(counted, device)
        occurrences = (rows_, token_ids, frequency * count + presence * (count > 0))
    return LogitsProcessors(_tensors(bias, device) if bias[0] else None,
                            _tensors(repetition, device) if repetition[0] else None, occurrences)


def _extend(entries: tuple[list, ...], row: int, token_ids, *values) -> None:
    token_ids = list(token_ids)
    entries[0].extend([row] * len(token_ids))
    entries[1].extend(token_ids)
    for column, column_values in zip(entries[2:], values):
        column.extend(column_values)


def _tensors(entries: tuple[list, ...], device: torch.device) -> tuple[torch.Tensor, ...]:
    """Rows and token ids as int64, values as float32 (the logits' dtype in the sampler)."""
    return tuple(torch.tensor(column, dtype=torch.int64 if i < 2 else torch.float32, device=device)
                 for i, column in enumerate(entries))


def apply_logits_processors(logits: torch.Tensor, processors: LogitsProcessors | None) -> torch.Tensor:
    """The batch's logits in float32 with every row's processing applied: a new tensor whenever
    anything changes, so the caller's raw logits stay as they were (logprobs are read from them)."""
    if processors is None:
        return logits.float()
    logits = logits.to(torch.float32, copy=True)
    if processors.bias is not None:
        rows, token_ids, values = processors.bias
        logits.index_put_((rows, token_ids), values, accumulate=True)  # a bias and a hold-back add up
    if processors.repetition is not None:
        rows, token_ids, penalties = processors.repetition
        seen = logits[rows, token_ids]
        logits[rows, token_ids] = torch.where(seen > 0, seen / penalties, seen * penalties)
    if processors.occurrences is not None:
        rows, token_ids, penalties = processors.occurrences
        logits[rows, token_ids] -= penalties
    return logits
