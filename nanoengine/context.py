"""Per-step attention metadata: what every attention layer needs to know about the batch.

The model runner builds one ``Context`` per step and passes it down through the model. The
field names and meanings are flash-attn's, so the same metadata drives the CUDA kernels and the
CPU reference functions.
"""

from dataclasses import dataclass

import torch


@dataclass
class Context:
    is_prefill: bool
    # Where each token's new K/V goes: block_id * block_size + offset, or -1 for a padded row.
    slot_mapping: torch.Tensor
    # Prefill: sequences are packed back to back; sequence i's queries are
    # q[cu_seqlens_q[i]:cu_seqlens_q[i+1]] and its keys span cu_seqlens_k likewise (longer than its
    # queries when a cached prefix is read back from the KV cache through the block tables).
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    # Decode: how many tokens of K/V each sequence has in the cache, this step's included.
    context_lens: torch.Tensor | None = None
    # [num_seqs, max_num_blocks] physical block ids; None in a prefill with no cached prefix.
    block_tables: torch.Tensor | None = None
    # Prefill: the rows whose logits are needed: the last token of each sequence whose step reaches
    # its end (a prompt chunk with more to come samples nothing), and the positions that score prompt
    # logprobs where asked. Decode: None, every row samples.
    logits_indices: torch.Tensor | None = None
    # [num_copies, 2] (source, destination) blocks to copy before the forward: copy on write for
    # forked samples that share a partly filled block (block_manager.py). None when there are none.
    blocks_to_copy: torch.Tensor | None = None
