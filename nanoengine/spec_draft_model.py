"""The draft-model proposer: a small model of the same tokenizer guesses the target's next tokens.

It is a second, smaller engine inside the first, reusing its pieces: a ``ModelRunner`` over the
draft's weights with a paged KV cache of its own, and a ``BlockManager`` over that cache. Every
target sequence it drafts for has a *shadow* sequence there, which holds the tokens the draft has
seen and their K/V. To propose ``k`` tokens the draft first catches its shadows up with their
targets (one prefill-shaped step over the tokens it has not computed), then decodes greedily
``k - 1`` more steps, each feeding back the draft before.

Taking tokens back is the same lesson as in the target's cache, in miniature: before each
proposal a shadow keeps only the prefix it shares with its target (the drafts the target
accepted stay; the rest are cut off), and ``num_computed_tokens`` falls back to it, so K/V past
that point are never read and are overwritten by the catch-up step.

The drafts are the draft's argmax, a deterministic guess: the rejection sampler's ``q`` is then a
point mass, and the target's distribution is kept exactly whatever the draft says.
"""

import dataclasses

from transformers import PretrainedConfig

from nanoengine.block_manager import BlockManager
from nanoengine.config import Config
from nanoengine.loader import checkpoint_directory, load_hf_config, resolve_model_path
from nanoengine.model_runner import ModelRunner
from nanoengine.sampling_params import SamplingParams
from nanoengine.sequence import Sequence, SequenceStatus
from nanoengine.spec_decode import SpeculativeConfig

GREEDY = SamplingParams(temperature=0.0, max_tokens=1 << 30)


class DraftModelProposer:
    def __init__(self, spec: SpeculativeConfig, config: Config, target: PretrainedConfig, num_kvcache_blocks: int):
        try:
            path = checkpoint_directory(resolve_model_path(spec.model))
        except ValueError as e:
            raise ValueError(f"speculative_config.model: {e}") from None
        draft = load_hf_config(path)
        if draft.vocab_size != target.vocab_size:
            raise ValueError(f"speculative_config.model has a vocabulary of {draft.vocab_size} tokens, the target "
                             f"{target.vocab_size}: a draft model must share the target's tokenizer")
        if draft.max_position_embeddings < config.max_model_len:
            raise ValueError(f"speculative_config.model's context ({draft.max_position_embeddings} tokens) is "
                             f"shorter than max_model_len={config.max_model_len}")
        # As many blocks as the target's cache: the draft then holds whatever the target holds. (On
        # CUDA that memory comes on top of gpu_memory_utilization's budget, which sized the target's.)
        draft_config = dataclasses.replace(config, model=spec.model, speculative_config=None,
                                           num_kvcache_blocks=num_kvcache_blocks, tensor_parallel_size=1)
        self.runner = ModelRunner(draft_config, draft, path)
        self.block_manager = BlockManager(num_kvcache_blocks, self.runner.block_size, enable_prefix_caching=False)
        self.shadows: dict[int, tuple[Sequence, Sequence]] = {}  # target seq_id -> (target, shadow)

    def propose(self, seqs: list[Sequence], max_drafts: list[int]) -> list[list[int]]:
        self._forget_finished()
        drafting = [(seq, self._shadow(seq, k), k) for seq, k in zip(seqs, max_drafts) if k > 0]
        drafting = [(seq, shadow, k) for seq, shadow, k in drafting if shadow is not None]
        drafts = {seq.seq_id: [] for seq, _, _ in drafting}
        for step in range(max((k for _, _, k in drafting), default=0)):
            batch = [(seq, shadow) for seq, shadow, k in drafting if k > step]
            for _, shadow in batch:
                shadow.status = SequenceStatus.RUNNING
                shadow.num_scheduled_tokens = shadow.num_tokens - shadow.num_computed_tokens
            out = self.runner.run([shadow for _, shadow in batch])
            for (seq, shadow), (token_id,) in zip(batch, out.token_ids):
                shadow.num_computed_tokens = shadow.num_tokens
                shadow.token_ids.append(token_id)
                drafts[seq.seq_id].append(token_id)
        return [drafts.get(seq.seq_id, []) for seq in seqs]

    def _shadow(self, seq: Sequence, k: int) -> Sequence | None:
        """``seq``'s shadow, caught up with its tokens (the K/V of their common prefix kept), with
        blocks for the ``k - 1`` drafts it will feed back; None if the draft's cache is full."""
        if seq.seq_id in self.shadows:
            shadow = self.shadows[seq.seq_id][1]
            common = next((i for i, (a, b) in enumerate(zip(shadow.token_ids, seq.token_ids)) if a != b),
                          min(len(shadow.token_ids), len(seq.token_ids)))
            shadow.token_ids = list(seq.token_ids)
            shadow.num_computed_tokens = min(shadow.num_computed_tokens, common, seq.num_tokens - 1)
            if self.block_manager.can_append(shadow, k - 1):
                self.block_manager.may_append(shadow, k - 1)
                return shadow
            self._free(seq.seq_id)
            return None
        shadow = Sequence(seq.token_ids, GREEDY, self.runner.block_size)
        if -(-(shadow.num_tokens + k - 1) // shadow.block_size) > self.block_manager.num_free_blocks:
            return None
        self.block_manager.allocate(shadow)
        self.block_manager.may_append(shadow, k - 1)
        self.shadows[seq.seq_id] = (seq, shadow)
        return shadow

    def _forget_finished(self) -> None:
        """Free the shadows of sequences that finished or were preempted (a preempted one starts over)."""
        for seq_id, (seq, _) in list(self.shadows.items()):
            if seq.status != SequenceStatus.RUNNING:
                self._free(seq_id)

    def _free(self, seq_id: int) -> None:
        self.block_manager.deallocate(self.shadows.pop(seq_id)[1])
