"""Logits processors: what a request changes in its logits before the sampler picks a token.

In vLLM's order (its V1 sampler's): ``logit_bias`` is added, ``min_tokens`` holds the stop tokens
back and ``bad_words`` bans the token that would complete a bad word (-inf), then the penalties:
HF's repetition penalty over the prompt and the completion (a positive logit divided by it, a
negative one multiplied), then OpenAI's presence and frequency penalties over the completion only,
``logit -= frequency_penalty * count + presence_penalty * (count > 0)``. Greedy rows take the
argmax of the result; temperature, min-p, top-k and top-p follow in the sampler. Logprobs are read
from the raw logits, which are left as they were.

Each processor changes only a few tokens of a row (its biased tokens, its stop tokens, the tokens
it has seen), so a step's processing is a list of (row, token id) entries flattened over the whole
batch, applied with one gather and one scatter per kind, never a pass over the vocabulary, and
never a loop over rows on the device. A step in which no row uses any of them builds nothing
(``build_logits_processors`` returns None) and skips the pass.

``apply_logits_processors`` is the one seam. The one kind that is not a few entries is applied
there last: rows restricted to some tokens (``restrict``), by a grammar (structured_output.py) or
``allowed_token_ids`` (a mask made once per request), get -inf wherever their mask says no. And a
speculative verifier applies the same processing to its draft positions by building rows whose
tokens include the drafts before them.
"""

import array
from dataclasses import dataclass

import torch

from nanoengine.sampling_params import MAX_LOGIT, SamplingParams

# Per row: its parameters, its token ids (prompt, then completion), the prompt's length, how
# often each token occurs in the completion (None unless a penalty is on), and its bad words' token
# ids (each word as the tokenizer writes it: input_processor.py).
Row = tuple[SamplingParams, list[int], int, dict[int, int] | None, list[list[int]]]


@dataclass
class LogitsProcessors:
    """A step's processing as (rows, token ids, values) entries; a kind that no row uses is None."""

    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # added: logit_bias; -inf: min_tokens, bad_words
    repetition: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # each seen token's penalty
    occurrences: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # subtracted: presence and frequency
    # Rows restricted to some tokens, and their masks of allowed tokens [rows, vocab] (``restrict``).
    allowed: tuple[torch.Tensor, torch.Tensor] | None = None


def build_logits_processors(rows: list[Row], eos_token_ids: set[int], device: torch.device,
                            allowed: tuple[torch.Tensor, torch.Tensor] | None = None) -> LogitsProcessors | None:
    """The entries of a batch's rows (and its rows' ``allowed`` tokens, as ``restrict`` gives
    them), or None when no row asks for any processing."""
    bias, repetition, counted = _Entries(), _Entries(), _Entries()
    for row, (params, token_ids, num_prompt_tokens, counts, bad_words) in enumerate(rows):
        if params.logit_bias:
            bias.add(row, params.logit_bias.keys(), params.logit_bias.values())  # capped at MAX_LOGIT
        if len(token_ids) - num_prompt_tokens < params.min_tokens:
            held_back = set(params.stop_token_ids) | (set() if params.ignore_eos else eos_token_ids)
            bias.add(row, held_back, [float("-inf")] * len(held_back))
        if bad_words and (banned := _completing(bad_words, token_ids[num_prompt_tokens:])):
            bias.add(row, banned, [float("-inf")] * len(banned))
        if params.repetition_penalty != 1:
            # A token both in the prompt and the completion is two entries; both write the same value.
            repetition.add(row, token_ids[:num_prompt_tokens] + list(counts), row_values=[params.repetition_penalty])
        if params.presence_penalty or params.frequency_penalty:
            counted.add(row, counts.keys(), counts.values(), [params.presence_penalty, params.frequency_penalty])
    if not (bias.token_ids or repetition.token_ids or counted.token_ids or allowed):
        return None
    processors = LogitsProcessors(None, None, None, allowed)
    if bias.token_ids:
        processors.bias = bias.tensors(device)
    if repetition.token_ids:
        rows_, token_ids, _, penalty = repetition.tensors(device)
        processors.repetition = (rows_, token_ids, penalty)
    if counted.token_ids:
        rows_, token_ids, count, presence, frequency = counted.tensors(device)
        processors.occurrences = (rows_, token_ids, frequency * count + presence * (count > 0))
    return processors


def restrict(by_grammar: tuple[torch.Tensor, torch.Tensor] | None, masks: list[torch.Tensor | None],
             device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The rows restricted to some tokens and their masks: a grammar's (structured_output's
    ``allowed_tokens``: rows and masks, on the CPU), a row's ``allowed_token_ids`` (``masks``: per
    row, its request's mask or None), or where both apply, the tokens both allow; where they
    allow none in common, the grammar's, which the output must follow. None when no row is."""
    restricted = {} if by_grammar is None else dict(zip(by_grammar[0].tolist(), by_grammar[1]))
    for row, mask in enumerate(masks):
        if mask is not None:
            both = restricted[row] & mask if row in restricted else mask
            restricted[row] = both if both.any() else restricted[row]
    if not restricted:
        return None
    return torch.tensor(list(restricted), device=device), torch.stack(list(restricted.values())).to(device)


def _completing(bad_words: list[list[int]], completion: list[int]) -> set[int]:
    """The tokens that would complete a bad word next: each word's last token, where the
    completion ends in the word's other tokens (a one-token word: always), as vLLM bans them."""
    return {word[-1] for word in bad_words
            if len(word) <= len(completion) + 1 and completion[len(completion) - len(word) + 1:] == word[:-1]}


class _Entries:
    """One kind's entries, collected row by row. Only a token id and a value per entry go through
    Python lists (packed by ``array``, at C speed: ``torch.tensor`` reads a list one number at a
    time, 1.3 ms for 14k token ids here, against 0.3); a row's index and parameters go once per row
    and are repeated over its entries by torch. Built per entry, the lists cost more than the
    processing itself."""

    def __init__(self):
        self.rows, self.lengths, self.row_values, self.token_ids, self.values = [], [], [], [], []

    def add(self, row: int, token_ids, values=(), row_values=()) -> None:
        token_ids = list(token_ids)
        self.rows.append(row)
        self.lengths.append(len(token_ids))
        self.row_values.append(list(row_values))
        self.token_ids += token_ids
        self.values += values

    def tensors(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """Per entry: its row, token id and value, and its row's values (one tensor per column)."""
        lengths = torch.tensor(self.lengths, device=device)
        row_values = torch.tensor(self.row_values, dtype=torch.float32, device=device)
        row_values = row_values.repeat_interleave(lengths, dim=0)
        return (torch.tensor(self.rows, device=device).repeat_interleave(lengths),
                _packed(self.token_ids, "q", device), _packed(self.values, "f", device), *row_values.T)


def _packed(values: list, typecode: str, device: torch.device) -> torch.Tensor:
    """``torch.tensor(values)`` in int64 ("q") or float32 ("f"), through an ``array``."""
    dtype = torch.int64 if typecode == "q" else torch.float32
    if not values:  # frombuffer refuses an empty buffer
        return torch.empty(0, dtype=dtype, device=device)
    return torch.frombuffer(array.array(typecode, values), dtype=dtype).to(device)  # the tensor keeps it alive


def apply_logits_processors(logits: torch.Tensor, processors: LogitsProcessors | None) -> torch.Tensor:
    """The batch's logits with every row's processing applied: a new float32 tensor whenever anything
    changes, so the caller's raw logits stay as they were (logprobs are read from them); the raw
    logits themselves when nothing does (the sampler's first step, the temperature, makes float32)."""
    if processors is None:
        return logits
    raw, logits = logits, logits.to(torch.float32, copy=True)
    if processors.bias is not None:
        rows, token_ids, values = processors.bias
        logits.index_put_((rows, token_ids), values, accumulate=True)  # a bias and a hold-back add up
    if processors.repetition is not None:
        rows, token_ids, penalties = processors.repetition
        seen = logits[rows, token_ids]
        logits[rows, token_ids] = torch.where(seen > 0, seen / penalties, seen * penalties).clamp_max(MAX_LOGIT)
    if processors.occurrences is not None:
        rows, token_ids, penalties = processors.occurrences
        logits[rows, token_ids] -= penalties
    if processors.allowed is not None:  # last: whatever the rest did, a disallowed token stays out
        rows, masks = processors.allowed
        masks = masks[:, :logits.shape[-1]]
        restricted = logits[rows].masked_fill(~masks, float("-inf"))
        # The bans (min_tokens' hold-back, bad_words) may cover every token a row allows: such a row
        # takes its allowed tokens as the model ranks them (the restriction wins), rather than
        # sampling from a row of -inf, which gives nonsense, and a token its grammar refuses. Rare,
        # so the raw logits are read again only for such rows.
        if (empty := restricted.isneginf().all(dim=1)).any():
            restricted[empty] = raw[rows[empty]].float().masked_fill(~masks[empty], float("-inf"))
        logits[rows] = restricted
    return logits
