"""A sequence: one request's tokens and its place in the paged KV cache.

The scheduler moves sequences between queues, the block manager fills in their block tables,
and the model runner reads both to build each step's inputs.
"""

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
        self.finish_reason: str | None = None

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
    def samples_this_step(self) -> bool:
        """Whether this step's tokens reach the sequence's end, so that it samples the next one."""
        return self.num_computed_tokens + self.num_scheduled_tokens == self.num_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def block(self, i: int) -> list[int]:
        """Token ids of logical block ``i``."""
        return self.token_ids[i * self.block_size:(i + 1) * self.block_size]

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
