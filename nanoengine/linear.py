"""The decoder's projections and its embedding: one ``Linear`` that may compute three ways, and the
tensor-parallel splits built on it.

A ``Linear`` is ``nn.Linear`` until the model runner changes how it computes: on CPU in bf16 with
AVX512-BF16, a C++ kernel over a packed copy of its weight (``use_cpu_kernel``); with
``quantization``, a C++ kernel over int8 or int4 weights (``quantize``, quantization.py). Either
replaces the plain weight, so each layer holds one copy of what it computes with; but for one
case: the quantized kernel is made for one row of x, and where oneDNN's int8 GEMM is faster for a
batch of rows on this CPU, the layer also keeps an int8 copy in the layout that GEMM reads and
computes batches from so many rows on through it (cpu_int8_gemm.py).

Projections that read the same input are fused into one matmul (q/k/v into ``qkv_proj``,
gate/up into ``gate_up_proj``): one large product instead of several small ones. Checkpoints
store them separately, so a ``PackedLinear`` knows where each checkpoint tensor goes.

With tensor parallelism (parallel.py) each layer holds only its rank's part of a weight, and knows
which part (a ``Shard``), so the loader reads just that (``checkpoint_part``) and the layer adds
the one collective its split needs; the model says which split each layer gets (Megatron's):

    column-parallel (PackedLinear: qkv_proj by heads, gate_up_proj; the LM head by vocabulary):
        each rank holds some output rows, computes those output features; no communication
        (the LM head's logits are gathered to rank 0, where sampling happens)
    row-parallel (RowParallelLinear: o_proj, down_proj): each rank holds the input columns that
        match the features its column-parallel layer made, so its product is a partial sum:
        all-reduce (the bias is added on rank 0 only, so it counts once)
    vocab-parallel embedding: each rank looks up the ids in its rows, zeros elsewhere: all-reduce
    a norm over a whole column-parallel projection (``ShardedRMSNorm``, OLMoE's q/k norms): each
    rank's sum of squares over its features, all-reduced into the mean square of them all

So a decoder layer costs two all-reduces (four with OLMoE's norms). At ``tensor_parallel_size=1``
every layer holds a whole tensor (``Shard.whole``) and its forward is the plain one.
"""

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from nanoengine import cpu_int8_gemm, cpu_kernels, quantization
from nanoengine.parallel import Shard, TensorParallelGroup


class Linear(nn.Linear):
    """``nn.Linear``, which on CPU in bf16 runs a C++ kernel over a packed copy of its weight, or
    computes over a quantized copy of it (quantization.py)."""

    kernel: Callable | None = None
    quantized = False
    gemm_min_rows: int | None = None  # from this many rows of x on, compute through cpu_int8_gemm.py

    def use_cpu_kernel(self) -> None:
        """From now on compute with cpu_kernels.linear over ``packed_weight``, the weight laid out for
        that kernel to stream front to back. The packed copy replaces the plain weight, as a buffer,
        so that ``state_dict`` holds what the layer computes with and ``load_state_dict`` takes it
        back (a tied lm_head's weight lives on as the embedding table)."""
        packed_weight = cpu_kernels.pack_linear_weight(self.weight.detach())
        self.register_parameter("weight", None)
        self.register_buffer("packed_weight", packed_weight)
        self.kernel = cpu_kernels.linear

    def quantize(self, fmt: str) -> None:
        """From now on compute with cpu_kernels.quantized_linear over ``qweight`` and ``scales``, the
        weight in ``fmt`` ("int8" or "int4"; int4's scales are inside qweight). Like
        ``use_cpu_kernel``, the quantized copy replaces the weight as buffers; a tied lm_head gets its
        own copy and the embedding keeps the original. Where cpu_int8_gemm.py computes batches, its
        int8 copy is kept too (``gemm_weight``, ``gemm_scales``), made from the quantized weight a
        block of rows at a time, so that no float32 copy of the whole weight is ever made."""
        qweight, scales = quantization.quantize_weight(self.weight.detach(), fmt)
        self.register_parameter("weight", None)  # the float weight is gone from here on (the loader holds none)
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)
        self.quantized = True
        self.gemm_min_rows = cpu_int8_gemm.gemm_min_rows(fmt) if cpu_int8_gemm.available() else None
        if self.gemm_min_rows is not None:
            blocks = [cpu_int8_gemm.quantize_weight(quantization.dequantize_packed(q, s))
                      for q, s in quantization.packed_row_blocks(qweight, scales)]
            self.register_buffer("gemm_weight", cpu_int8_gemm.pack_weight(torch.cat([q for q, _ in blocks])))
            self.register_buffer("gemm_scales", torch.cat([s for _, s in blocks]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.quantized and self.gemm_min_rows is not None and x.numel() >= self.gemm_min_rows * x.shape[-1]:
            return cpu_int8_gemm.int8_linear(x, self.gemm_weight, self.gemm_scales, bias)
        if self.quantized:
            return cpu_kernels.quantized_linear(x, self.qweight, self.scales, bias, self.out_features)
        if self.kernel is None:
            return F.linear(x, self.weight, bias)
        return self.kernel(x, self.packed_weight, bias, self.out_features)


CheckpointPart = tuple[tuple[int, ...], tuple[slice, ...], torch.Tensor]


class PackedLinear(Linear):
    """A linear layer whose output rows are several checkpoint projections stacked together, each
    whole or (column parallelism) one rank's rows of it."""

    def __init__(self, in_features: int, shards: dict[str | int | None, Shard], bias: bool):
        super().__init__(in_features, sum(shard.size for shard in shards.values()), bias=bias)
        self.shards, self.shard_offsets, offset = shards, {}, 0
        for shard_id, shard in shards.items():
            self.shard_offsets[shard_id] = offset
            offset += shard.size

    def checkpoint_part(self, param_name: str, shard_id: str | int | None) -> CheckpointPart:
        """For the loader: the checkpoint tensor's shape, the part of it this rank holds, and where
        that goes (a view of ``param_name``, "weight" or "bias")."""
        shard, offset = self.shards[shard_id], self.shard_offsets[shard_id]
        rows = min(shard.size, shard.total - shard.start)  # without the padding
        param = getattr(self, param_name).data
        param[offset + rows:offset + shard.size].zero_()  # nothing loads the padding: zero, not garbage
        return (shard.total, *param.shape[1:]), (slice(shard.start, shard.start + rows),), param[offset:offset + rows]


class RowParallelLinear(Linear):
    """Row parallelism: the input columns ``in_shard`` of the checkpoint's weight. Each rank's product
    is a partial sum, all-reduced; rank 0 alone adds the bias, so it counts once."""

    def __init__(self, in_shard: Shard, out_features: int, bias: bool, tp: TensorParallelGroup | None):
        super().__init__(in_shard.size, out_features, bias=bias)
        self.in_shard, self.tp = in_shard, tp
        self.adds_bias = tp is None or tp.rank == 0

    def checkpoint_part(self, param_name: str, shard_id: None) -> CheckpointPart:
        if param_name == "bias":
            return tuple(self.bias.shape), (slice(None),), self.bias.data
        columns = slice(self.in_shard.start, self.in_shard.start + self.in_shard.size)
        return (self.out_features, self.in_shard.total), (slice(None), columns), self.weight.data

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.matmul(x, self.bias if self.adds_bias else None)
        return out if self.tp is None else self.tp.all_reduce(out)


class ShardedRMSNorm(nn.Module):
    """RMSNorm over a whole projection that column parallelism split: this rank holds the features
    ``shard`` of it, and that part of the weight. The mean square is over every feature: the ranks'
    sums of squares are all-reduced. Where ``replicas`` ranks hold the same features (kv heads fewer
    than ranks), each one's sum arrives that many times, and is divided back."""

    def __init__(self, shard: Shard, eps: float, tp: TensorParallelGroup, replicas: int = 1):
        super().__init__()
        self.shard, self.eps, self.tp, self.replicas = shard, eps, tp, replicas
        self.weight = nn.Parameter(torch.ones(shard.size))

    def checkpoint_part(self, param_name: str, shard_id: None) -> CheckpointPart:
        return (self.shard.total,), (slice(self.shard.start, self.shard.start + self.shard.size),), self.weight.data

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        square_sums = self.tp.all_reduce(x32.pow(2).sum(-1, keepdim=True)) / self.replicas
        return self.weight * (x32 * torch.rsqrt(square_sums / self.shard.total + self.eps)).to(x.dtype)


class VocabParallelEmbedding(nn.Embedding):
    """The embedding table's rows ``shard`` (part of the vocabulary). A rank looks up the ids in its
    rows and gives zeros for the rest; the all-reduce fills in every row from the rank that has it."""

    def __init__(self, shard: Shard, embedding_dim: int, tp: TensorParallelGroup | None):
        super().__init__(shard.size, embedding_dim)
        self.shard, self.tp = shard, tp

    def checkpoint_part(self, param_name: str, shard_id: None) -> CheckpointPart:
        rows = min(self.shard.size, self.shard.total - self.shard.start)
        self.weight.data[rows:].zero_()  # nothing loads the padding: zero, not garbage (a tied LM head reads it)
        return ((self.shard.total, self.embedding_dim), (slice(self.shard.start, self.shard.start + rows),),
                self.weight.data[:rows])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return super().forward(input_ids)
        local_ids = input_ids - self.shard.start
        outside = (local_ids < 0) | (local_ids >= self.shard.size)
        hidden = F.embedding(local_ids.masked_fill(outside, 0), self.weight).masked_fill(outside[:, None], 0)
        return self.tp.all_reduce(hidden)


class ParallelLMHead(PackedLinear):
    """The LM head, its rows (vocabulary) ``shard``; the logits are gathered to rank 0 (None elsewhere)."""

    def __init__(self, shard: Shard, embedding_dim: int, tp: TensorParallelGroup | None):
        super().__init__(embedding_dim, {None: shard}, bias=False)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor | None:
        logits = super().forward(x)
        if self.tp is None:
            return logits
        logits = self.tp.gather(logits)
        return None if logits is None else logits[..., :self.shards[None].total]


def quantize_linear(name: str, module: nn.Module, fmt: str) -> None:
    """Switch a linear layer to weights in ``fmt`` where the kernel takes its shape
    (quantization.can_quantize); the rest keep theirs. The LM head is never below int8 (as llama.cpp
    keeps its output tensor wider): in int4 it cost the default model 8% perplexity, in int8 0.5%.
    The loader calls this on each module as soon as its weights are in (``loaded``), so that the
    full-precision model is never held whole."""
    if isinstance(module, Linear) and not module.quantized and quantization.can_quantize(
            module.out_features, module.in_features):
        module.quantize("int8" if name == "lm_head" else fmt)


def quantize_linears(model: nn.Module, fmt: str) -> None:
    """``quantize_linear`` on every layer not yet quantized: after loading, a tied LM head, which no
    checkpoint tensor fills (it quantizes a copy of the embedding)."""
    for name, module in model.named_modules():
        quantize_linear(name, module, fmt)
