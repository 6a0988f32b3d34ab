"""The model runner: owns the model and the KV cache, and turns scheduled sequences into tokens.

Each step it packs the scheduled sequences into flat input tensors, builds the step's attention
metadata (slot mapping, cu_seqlens or context lengths, block tables), runs the model, and
samples one token per sequence.
"""

import contextlib
import ctypes
import math
import mmap

import torch
from torch.overrides import TorchFunctionMode
from transformers import PretrainedConfig

from nanoengine import cpu_kernels, quantization
from nanoengine.attention import Attention, get_backend
from nanoengine.config import Config
from nanoengine.context import Context
from nanoengine.cpu_library import cpu_features, load
from nanoengine.graph_runner import DecodeGraphRunner
from nanoengine.layers import Linear, RMSNorm, RotaryEmbedding, SiluAndMul
from nanoengine.loader import load_weights
from nanoengine.model import CausalLM
from nanoengine.sampler import Sampler
from nanoengine.sequence import Sequence

CPU_KVCACHE_BYTES = 1 << 30  # the RAM budget for the KV cache on CPU


def keep_freed_memory_for_reuse() -> None:
    """On CPU, stop glibc's malloc from handing large freed buffers back to the kernel.

    Every step allocates the same large activations again (a prefill's MLP output alone is tens
    of MB). By default glibc serves such sizes with a fresh ``mmap`` and unmaps them on free, so
    each step pays a page fault per 4 KiB touched; measured here, that made SiLU and the
    element-wise products of prefill 3-10x slower than the arithmetic, and the whole benchmark
    ~20% slower. Raising the mmap and trim thresholds keeps freed memory in the heap, where the
    next step finds it already mapped; the cost is that resident memory stays at its peak.
    A no-op where the C library is not glibc.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
        libc.mallopt(M_MMAP_THRESHOLD, 1 << 30)
        libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1)
    except (OSError, AttributeError):
        pass


def kvcache_budget_bytes(total: int, free: int, torch_reserved: int, torch_peak: int, graph_pool: int,
                         utilization: float) -> int:
    """Bytes left for the KV cache on a GPU, from memory figures taken after the warm-up.

    Our share is ``total * utilization``. From it come: what lives outside PyTorch's allocator
    (``total - free - torch_reserved``: the CUDA context, library workspaces, other processes; a
    process already using part of the GPU shrinks our share rather than being overrun), this
    process's peak of tensors (weights plus the largest step's activations), and room for the
    CUDA-graph pool, which is allocated after the cache because graphs capture its address.
    """
    outside_torch = total - free - torch_reserved
    return int(total * utilization) - outside_torch - torch_peak - graph_pool


def warmup_lengths(num_tokens: int, max_num_seqs: int, max_model_len: int) -> list[int]:
    """Prompt lengths for the warm-up: the largest step the scheduler can form.

    All ``num_tokens`` of the step's budget, in as many sequences as a step may hold (each one
    logit row), none longer than ``max_model_len`` (the rotary table's length).
    """
    num_seqs = max(min(max_num_seqs, num_tokens), -(-num_tokens // max_model_len))
    return [num_tokens // num_seqs + (i < num_tokens % num_seqs) for i in range(num_seqs)]


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """Create parameters directly in ``dtype``: building in float32 and casting would hold twice
    the weights' final size at the peak. Restored on exit, so the process's default is untouched."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


class skip_weight_init(TorchFunctionMode):
    """Build a model without ``torch.nn.init``'s random fills: ``load_weights`` overwrites every
    weight next, so filling them first is wasted work (0.8 s of ``kaiming_uniform_`` for the default
    model's 135M weights). Only ``torch.nn.init``'s functions are skipped; the rest of construction
    (norm weights of ones, the rotary table, which is computed rather than loaded) runs as usual. Like
    ``torch.device(...)``, a mode holds only in the block and the thread that enter it."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":
            return kwargs["tensor"]  # nn.init hands the tensor over by keyword
        return func(*args, **kwargs)


def use_cpu_kernels(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Point the model's RMSNorms, SiLU-and-muls and rotary embedding at the C++ kernels, if they
    build for ``dtype``; in bf16 on a CPU with AVX512-BF16, its linear layers too."""
    if dtype not in cpu_kernels.DTYPES or load("cpu_layers.cpp") is None:
        return
    kernels = {RMSNorm: cpu_kernels.add_rms_norm, SiluAndMul: cpu_kernels.silu_and_mul,
               RotaryEmbedding: cpu_kernels.rotary}
    packs_linears = (dtype == torch.bfloat16 and "avx512_bf16" in cpu_features().split()
                     and load("cpu_linear.cpp") is not None)
    for module in model.modules():
        if type(module) in kernels:
            module.kernel = kernels[type(module)]
        elif packs_linears and isinstance(module, Linear) and not module.quantized and module.in_features % 2 == 0:
            module.use_cpu_kernel()


def quantize_linears(model: torch.nn.Module, fmt: str) -> None:
    """Switch every linear layer to weights in ``fmt`` where torch's op takes its shape
    (quantization.can_quantize); the rest keep theirs. The LM head is never below int8 (as llama.cpp
    keeps its output tensor wider): in int4 it cost the default model 8% perplexity, in int8 0.5%."""
    for name, module in model.named_modules():
        layer_fmt = "int8" if name == "lm_head" else fmt
        if isinstance(module, Linear) and quantization.can_quantize(module.out_features, module.in_features, layer_fmt):
            module.quantize(layer_fmt)


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.zeros``, but on CPU in fresh anonymous memory (``mmap``), which the kernel hands out as
    zero pages, each faulted in when first written: the 1 GiB CPU KV cache is ready at once (filling
    it with zeros took 1-1.6 s here) and takes RAM only for blocks that have held tokens; the step
    that first fills a block pays for its pages instead. Unlike memory from the heap, it never holds
    a freed tensor's bytes, and it goes back to the kernel when the tensor is freed."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    # Private, as heap memory is: Python's default for an anonymous map is shared, which here took
    # 1.5x as long to fault in and would be written through by a forked child.
    buffer = mmap.mmap(-1, math.prod(shape) * dtype.itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).view(shape)  # the tensor keeps it alive


def kvcache_block_size(requested: int | None, device: torch.device) -> int:
    """The KV block size: 256 on CUDA (flash-attn's paged KV needs pages of a multiple of 256), 16 on CPU."""
    block_size = requested or (256 if device.type == "cuda" else 16)
    if device.type == "cuda" and block_size % 256:
        raise ValueError(f"kvcache_block_size={block_size}: flash-attn's paged KV cache on CUDA needs a "
                         "multiple of 256 (leave it unset for 256, or pass device='cpu')")
    return block_size


class ModelRunner:
    def __init__(self, config: Config, hf_config: PretrainedConfig, model_path: str):
        self.device, self.dtype = config.torch_device, config.torch_dtype
        self.block_size = kvcache_block_size(config.kvcache_block_size, self.device)
        if self.device.type == "cpu":
            keep_freed_memory_for_reuse()
        # RotaryEmbedding's angle table names float32 itself, so it stays float32 in here.
        with torch.device(self.device), default_dtype(self.dtype), skip_weight_init():
            self.model = CausalLM(hf_config, max_position=config.max_model_len).eval()
        load_weights(self.model, model_path)
        if config.quantization is not None:
            quantize_linears(self.model, config.quantization)
        if self.device.type == "cpu":
            use_cpu_kernels(self.model, self.dtype)
        self.sampler = Sampler()
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        backend = get_backend(self.device)
        for layer in self.attention_layers:
            layer.backend = backend
        self.num_kvcache_blocks = config.num_kvcache_blocks or self._kvcache_blocks_for_budget(config)
        self._allocate_kvcache(self.num_kvcache_blocks)
        # Decode replays CUDA graphs captured over the cache just allocated; prefill stays eager.
        self.graph_runner = None
        if self.device.type == "cuda" and not config.enforce_eager:
            self.graph_runner = DecodeGraphRunner(
                self.model, config.max_num_seqs, -(-config.max_model_len // self.block_size), hf_config.hidden_size,
                self.device, self.dtype, use_cuda_graphs=True)

    def _kvcache_block_bytes(self) -> int:
        a = self.attention_layers[0]
        per_token = 2 * len(self.attention_layers) * a.num_kv_heads * a.head_dim * self.dtype.itemsize
        return per_token * self.block_size

    def _kvcache_blocks_for_budget(self, config: Config) -> int:
        if self.device.type == "cuda":
            self._allocate_kvcache(1)  # a stand-in of the right shape; the warm-up's slots are -1
            torch.cuda.reset_peak_memory_stats()
            weights = torch.cuda.memory_allocated()
            num_tokens = max(config.max_num_batched_tokens or max(8192, config.max_model_len), config.max_num_seqs)
            self.warmup(warmup_lengths(num_tokens, config.max_num_seqs, config.max_model_len))
            peak = torch.cuda.max_memory_allocated()
            # The graphs' pool holds the largest decode batch's activations: max_num_seqs tokens,
            # no more than the warm-up's num_tokens, so the warm-up's activations bound it.
            graph_pool = 0 if config.enforce_eager else peak - weights
            torch.cuda.empty_cache()  # hand the warm-up's activations back before the cache is allocated
            free, total = torch.cuda.mem_get_info()
            budget = kvcache_budget_bytes(total, free, torch.cuda.memory_reserved(), peak, graph_pool,
                                          config.gpu_memory_utilization)
        else:
            # Enough for every sequence at full length, within a fixed RAM budget.
            needed = config.max_num_seqs * -(-config.max_model_len // self.block_size) * self._kvcache_block_bytes()
            budget = min(CPU_KVCACHE_BYTES, needed)
        num_blocks = int(budget) // self._kvcache_block_bytes()
        if num_blocks <= 0:
            raise ValueError("no memory is left for the KV cache: raise gpu_memory_utilization, lower "
                             "max_num_batched_tokens or max_num_seqs, or free the GPU of other processes")
        return num_blocks

    def _allocate_kvcache(self, num_blocks: int) -> None:
        """One tensor for all layers; each layer sees ``[num_blocks, block_size, num_kv_heads, head_dim]``
        for K and for V, the layout flash-attn's paged KV cache reads."""
        a = self.attention_layers[0]
        # Zeroed, not empty: attention masks unused slots, and 0 * NaN garbage would still be NaN.
        self.kv_cache = zeros((2, len(self.attention_layers), num_blocks, self.block_size, a.num_kv_heads, a.head_dim),
                              self.dtype, self.device)
        for i, layer in enumerate(self.attention_layers):
            layer.k_cache, layer.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]

    @torch.inference_mode()
    def warmup(self, lengths: list[int]) -> None:
        """One prefill forward over prompts of these lengths, logits included, to measure its peak memory."""
        cu = torch.tensor([0] + lengths, dtype=torch.int32, device=self.device).cumsum(0, dtype=torch.int32)
        num_tokens = sum(lengths)
        ctx = Context(True, torch.full((num_tokens,), -1, dtype=torch.int64, device=self.device),
                      cu, cu, max(lengths), max(lengths))
        input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        positions = torch.cat([torch.arange(n, device=self.device) for n in lengths])
        self.model.compute_logits(self.model(input_ids, positions, ctx)[cu[1:] - 1])

    # -- per-step inputs ------------------------------------------------------------------------

    def _slots(self, seq: Sequence, start: int, end: int) -> list[int]:
        """Cache slots of the sequence's tokens ``start..end-1``."""
        bs, table = self.block_size, seq.block_table
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def _block_tables(self, seqs: list[Sequence]) -> torch.Tensor:
        width = max(len(seq.block_table) for seq in seqs)
        # Padding entries point at block 0: never read past a sequence's length, always in range.
        return self._tensor([seq.block_table + [0] * (width - len(seq.block_table)) for seq in seqs], torch.int32)

    def _tensor(self, data, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype, pin_memory=self.device.type == "cuda").to(self.device, non_blocking=True)

    def prepare_prefill(self, seqs: list[Sequence]):
        input_ids, positions, slots, cu_q, cu_k = [], [], [], [0], [0]
        for seq in seqs:
            start = seq.num_cached_tokens  # the cached prefix is read back, not recomputed
            input_ids += seq.token_ids[start:]
            positions += range(start, seq.num_tokens)
            slots += self._slots(seq, start, seq.num_tokens)
            cu_q.append(cu_q[-1] + seq.num_tokens - start)
            cu_k.append(cu_k[-1] + seq.num_tokens)
        has_cached_prefix = any(seq.num_cached_tokens for seq in seqs)
        ctx = Context(
            is_prefill=True, slot_mapping=self._tensor(slots, torch.int64),
            cu_seqlens_q=self._tensor(cu_q, torch.int32), cu_seqlens_k=self._tensor(cu_k, torch.int32),
            max_seqlen_q=max(b - a for a, b in zip(cu_q, cu_q[1:])),
            max_seqlen_k=max(b - a for a, b in zip(cu_k, cu_k[1:])),
            block_tables=self._block_tables(seqs) if has_cached_prefix else None)
        return self._tensor(input_ids, torch.int64), self._tensor(positions, torch.int64), ctx

    def prepare_decode(self, seqs: list[Sequence]):
        # Each sequence feeds its newest token, whose K/V is not in the cache yet.
        input_ids = [seq.token_ids[-1] for seq in seqs]
        positions = [seq.num_tokens - 1 for seq in seqs]
        slots = [seq.block_table[p // self.block_size] * self.block_size + p % self.block_size
                 for seq, p in zip(seqs, positions)]
        ctx = Context(is_prefill=False, slot_mapping=self._tensor(slots, torch.int64),
                      context_lens=self._tensor([seq.num_tokens for seq in seqs], torch.int32),
                      block_tables=self._block_tables(seqs))
        return self._tensor(input_ids, torch.int64), self._tensor(positions, torch.int64), ctx

    # -- the step -------------------------------------------------------------------------------

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], is_prefill: bool) -> list[int]:
        input_ids, positions, ctx = (self.prepare_prefill if is_prefill else self.prepare_decode)(seqs)
        if is_prefill or self.graph_runner is None:
            hidden = self.model(input_ids, positions, ctx)
        else:
            hidden = self.graph_runner.run(input_ids, positions, ctx)
        if is_prefill:
            hidden = hidden[ctx.cu_seqlens_q[1:] - 1]  # only each sequence's last token samples
        logits = self.model.compute_logits(hidden)
        params = [seq.sampling_params for seq in seqs]
        token_ids = self.sampler(logits, [p.temperature for p in params], [p.top_k for p in params],
                                 [p.top_p for p in params], [p.seed for p in params],
                                 [seq.num_tokens for seq in seqs])
        return token_ids.tolist()
