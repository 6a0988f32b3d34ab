"""A sequence: one sample's tokens and its place in the paged KV cache.

The scheduler moves sequences between queues, the block manager fills in their block tables,
and the model runner reads both to build each step's inputs.

A request is a *sequence group*: one sequence until its first sample, then ``n`` (as in vLLM,
the prompt is computed once). At that first sample the sequence draws all ``n`` tokens from its
one logit row and forks ``n - 1`` children, which share its KV blocks by reference count
(``BlockManager.fork``). From then on each is an ordinary sequence of its own: scheduled,
preempted and finished alone. ``group`` is the one list of a request's sequences, shared by all.
"""

import copy
from enum import Enum, auto
from itertools import count

from nanoengine.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    _ids = count()

    def __init__(self, prompt_token_ids: list[int], sampling_params: SamplingParams, block_size: int):
        self.seq_id = next(Sequence._ids)
        self.status = SequenceStatus.WAITING
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling_params = sampling_params
        self.block_size = block_size
        # Tokens at the start of the sequence whose K/V were found in the prefix cache when it was
        # last admitted (the model runner never computes them), and tokens whose K/V are in the
        # cache by now (cached or computed by earlier steps). The scheduler sets, for each step,
        # how many tokens past ``num_computed_tokens`` that step computes: a whole prompt, a chunk
        # of one, or 1 (the newest token, in decode).
        self.num_cached_tokens = 0
        self.num_computed_tokens = 0
        self.num_scheduled_tokens = 0
        self.block_table: list[int] = []
        # Speculative decoding's guesses at the tokens after ``token_ids`` (spec_decode.py): the
        # scheduler gives them lookahead slots and the next step computes them after the newest
        # token; the accepted ones are appended, and the list is emptied whenever a token lands.
        self.spec_token_ids: list[int] = []
        self.num_new_tokens = 0  # appended by the sequence's latest step: 1, or more with drafts accepted
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None  # vLLM's: the stop string or stop_token_ids id that ended it
        self.request_id = self.seq_id  # the first sequence's id names the request
        self.sample_index = 0  # which of the request's n samples this is
        self.group: list[Sequence] = [self]
        # Set by the engine: the completion's text, as it grows, and its stop strings; with
        # structured_outputs, the grammar's matcher at this sample's position (structured_output.py);
        # with bad_words, each word's token ids; with allowed_token_ids, a bool mask over the
        # vocabulary, made once, which every step's rows share (logits_processors.py).
        self.detokenizer = None
        self.grammar = None
        self.bad_words_token_ids: list[list[int]] = []
        self.allowed_token_mask = None
        # A pooling request's (runner="pooling", pooler.py): its PoolingParams, and what the model
        # runner pooled so far (a state carried across prompt chunks), its vector once it finishes.
        self.pooling_params = None
        self.pooled = None
        # Only when asked for: per generated token, {token_id: logprob}; per prompt token likewise.
        asked = sampling_params.logprobs is not None
        self.logprobs: list[dict[int, float]] | None = [] if asked else None
        self.cumulative_logprob: float | None = 0.0 if asked else None
        self.prompt_logprobs: list[dict[int, float] | None] | None = None
        # Only with a penalty: how often each token occurs in the completion, kept up to date as
        # tokens are appended, so a step reads it without counting the history again. A preempted
        # sequence keeps its tokens, so it keeps its counts too.
        self.output_token_counts: dict[int, int] | None = {} if sampling_params.penalizes else None

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_blocks(self) -> int:
        """Blocks needed to hold the K/V of every token the sequence has."""
        return (len(self.token_ids) + self.block_size - 1) // self.block_size

    @property
    def is_decode(self) -> bool:
        """Whether this step computes only the token sampled last, the one past the prompt without K/V."""
        return (self.num_scheduled_tokens == 1 and self.num_computed_tokens == self.num_tokens - 1
                and self.num_computed_tokens >= self.num_prompt_tokens)

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def scheduled_token_ids(self) -> list[int]:
        """The tokens this step computes: ``num_scheduled_tokens`` past the computed ones, running
        into the drafts when it has any."""
        start, end = self.num_computed_tokens, self.num_computed_tokens + self.num_scheduled_tokens
        tokens = self.token_ids[start:end]
        return tokens + self.spec_token_ids[:end - start - len(tokens)]

    def block(self, i: int) -> list[int]:
        """Token ids of logical block ``i``."""
        return self.token_ids[i * self.block_size:(i + 1) * self.block_size]

    @property
    def is_sampling(self) -> bool:
        """Whether this step's tokens reach the sequence's end, so that it samples (a prompt chunk
        with more to come does not); with drafts, past its end."""
        return self.num_computed_tokens + self.num_scheduled_tokens >= self.num_tokens

    @property
    def prompt_logprob_positions(self) -> range:
        """This step's positions whose logits score the prompt token after them (empty unless
        prompt logprobs are asked); the last prompt position scores a sample instead."""
        if not self.needs_prompt_logprobs:
            return range(0)
        start = self.num_computed_tokens
        return range(start, max(start, min(start + self.num_scheduled_tokens, self.num_prompt_tokens - 1)))

    @property
    def sample_indices(self) -> range:
        """The samples this sequence draws at its next sampling step: before its first token, all
        of its request's (children are forked for all but the first), then only its own."""
        if self.num_completion_tokens == 0:
            return range(self.sampling_params.n)
        return range(self.sample_index, self.sample_index + 1)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs are computed at the prefill before the first sample, never again."""
        return self.sampling_params.prompt_logprobs is not None and self.num_completion_tokens == 0

    def append_token(self, token_id: int, logprobs: dict[int, float] | None = None) -> None:
        self.token_ids.append(token_id)
        if self.output_token_counts is not None:
            self.output_token_counts[token_id] = self.output_token_counts.get(token_id, 0) + 1
        if self.logprobs is not None:
            self.logprobs.append(logprobs)
            self.cumulative_logprob += logprobs[token_id]

    def fork(self, sample_index: int) -> "Sequence":
        """A child sequence for sample ``sample_index``, made before the first token is appended:
        same tokens and block table (the block manager takes the references), its own state."""
        assert self.num_completion_tokens == 0
        child = copy.copy(self)
        child.seq_id, child.sample_index = next(Sequence._ids), sample_index
        child.token_ids, child.block_table = list(self.token_ids), list(self.block_table)
        child.logprobs = None if self.logprobs is None else []
        child.output_token_counts = None if self.output_token_counts is None else {}
        if self.detokenizer is not None:
            child.detokenizer = self.detokenizer.fork()
        if self.grammar is not None:
            child.grammar = self.grammar.deep_copy()
        self.group.append(child)
        return child
