"""Engine configuration: every knob a user can turn, validated once, up front.

``LLM(model, **kwargs)`` builds a ``Config`` from its keyword arguments, so an unknown or
out-of-range option fails here with a ``ValueError`` instead of deep inside a step.
"""

import importlib.util
import logging
from dataclasses import dataclass, field, fields

import torch

from nanoengine.kv_cache_dtype import check_kv_cache_dtype
from nanoengine.pooler import PoolerConfig, load_pooler_config
from nanoengine.sampling_params import is_int, is_number
from nanoengine.spec_decode import SpeculativeConfig

ATTENTION_BACKENDS = ("auto", "flash-attn", "triton", "torch")

logger = logging.getLogger(__name__)


def _triton_interprets() -> bool:
    """Whether Triton runs kernels in its interpreter, on CPU tensors (TRITON_INTERPRET=1)."""
    from triton import knobs  # imported only to ask: it takes a while
    return knobs.runtime.interpret


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


def kvcache_block_size(requested: int | None, attention_kernels: str) -> int:
    """The KV block size: 256 for flash-attn (its paged KV cache needs pages of a multiple of 256),
    else 16, which lets the prefix cache share prompts at a finer grain."""
    flash_attn = attention_kernels == "flash-attn"
    block_size = requested or (256 if flash_attn else 16)
    if flash_attn and block_size % 256:
        raise ValueError(f"kvcache_block_size={block_size}: flash-attn's paged KV cache needs a multiple of 256 "
                         "(leave it unset for 256, or pass attention_backend='triton')")
    return block_size


@dataclass
class Config:
    model: str | None = None
    max_num_batched_tokens: int | None = None  # None: max(8192, max_model_len)
    max_num_seqs: int = 256
    max_model_len: int | None = None  # None: min(4096, the model's context length)
    kvcache_block_size: int | None = None  # None: 256 with flash-attn (its page size), else 16
    num_kvcache_blocks: int | None = None  # None: sized from the memory budget
    enforce_eager: bool = False
    tensor_parallel_size: int = 1  # ranks the model is split over (worker.py)
    gpu_memory_utilization: float = 0.9
    device: str = "auto"
    dtype: str = "auto"
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = False  # mix decodes and prompt chunks in one step (scheduler.py)
    quantization: str | None = None  # None, "int8" or "int4": weight-only (quantization.py)
    # Which kernels attend (attention.py): "auto" is flash-attn on CUDA where it is installed, else the
    # Triton kernels; on CPU the C++ kernels. "torch" is the pure-torch reference on either device.
    attention_backend: str = "auto"
    # vLLM's: "auto" stores K/V in the model's dtype; "fp8" (= "fp8_e4m3") or "fp8_e5m2" in 8 bits,
    # twice the tokens in the same memory (kv_cache_dtype.py).
    kv_cache_dtype: str = "auto"
    # "auto" reads the checkpoint; "dummy" fills the model with random weights instead (vLLM's name),
    # for benchmarks on a machine that has a model's config.json and not its weights.
    load_format: str = "auto"
    skip_tokenizer_init: bool = False  # token-id prompts only; outputs carry token ids, text is None
    # vLLM's, which its scripts pass for models with code of their own: here the architectures are
    # built in and no checkpoint's code is ever run, so either value loads the same model.
    trust_remote_code: bool = False
    # Pure torch everywhere, for reading and stepping through in a debugger: no C++ kernels, no CUDA
    # graphs, attention by torch_attention.py's plain functions. Same tokens, slower.
    learner_mode: bool = False
    # What one request may ask for (engine.py checks them before anything is queued): logprobs per
    # token (vLLM's max_logprobs and default), and stop strings, each searched for in every sample's
    # new text at every token (100,000 of them slowed every other stream 7.5x); bad_words, checked
    # against every sample's tokens at every step, take the stop strings' limits.
    max_logprobs: int = 20
    max_stop_strings: int = 32
    max_stop_string_length: int = 256
    # Drafts checked by the target model several tokens a step (spec_decode.py), as vLLM's dict:
    # {"method": "ngram" | "draft_model", "num_speculative_tokens": k, ...}. None: one token a step.
    speculative_config: SpeculativeConfig | dict | None = None
    # Seeds the random draws of requests without a seed of their own (vLLM's engine seed), so a
    # run repeats; a request's own seed still wins. None: different draws every run.
    seed: int | None = None
    # vLLM's: "generate" (tokens), or "pooling", a vector per prompt (LLM.embed, /v1/embeddings:
    # pooler.py), pooled as pooler_config says ({"pooling_type": "LAST" | "MEAN" | "CLS", "normalize":
    # bool}; a field left unset is the model's).
    runner: str = "generate"
    pooler_config: PoolerConfig | dict | None = None
    # vLLM's: fields set on the model's HF config after it is read, e.g. {"sliding_window": 64}. (The
    # trace's sliding scene reads SmolLM2 as a Mistral with a short window this way.)
    hf_overrides: dict | None = None
    # Set by resolve_limits: whether max_model_len was left to default (it may then shrink to fit the cache).
    max_model_len_is_default: bool = field(default=False, init=False, repr=False)

    @classmethod
    def from_kwargs(cls, model: str | None, kwargs: dict) -> "Config":
        known = {f.name for f in fields(cls) if f.init} - {"model"}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown option(s) {unknown}; valid options are {sorted(known)}")
        return cls(model=model, **kwargs)

    def __post_init__(self):
        for name in ("max_num_batched_tokens", "max_model_len", "kvcache_block_size", "num_kvcache_blocks"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("enforce_eager", "enable_prefix_caching", "enable_chunked_prefill", "learner_mode",
                     "skip_tokenizer_init", "trust_remote_code"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        for name in ("max_logprobs", "max_stop_strings", "max_stop_string_length"):
            value = getattr(self, name)
            if not is_int(value) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if self.seed is not None and not is_int(self.seed):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if not is_int(self.max_num_seqs) or self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be a positive integer, got {self.max_num_seqs!r}")
        if not is_int(self.tensor_parallel_size) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {self.tensor_parallel_size!r}")
        # Strictly below 1: the rest is the margin for what no measurement sees (allocator rounding
        # and fragmentation, a library's lazily allocated workspace).
        if not (is_number(self.gpu_memory_utilization) and 0 < self.gpu_memory_utilization < 1):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1), got {self.gpu_memory_utilization!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' was asked for but torch sees no CUDA device")
        if self.dtype in ("half", "float"):  # vLLM's other names
            self.dtype = {"half": "float16", "float": "float32"}[self.dtype]
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ValueError(f"dtype must be 'auto', 'float32', 'float16' or 'bfloat16', got {self.dtype!r}")
        if self.quantization not in (None, "int8", "int4"):
            raise ValueError(f"quantization must be None, 'int8' or 'int4', got {self.quantization!r}")
        if self.quantization is not None and self.torch_device.type == "cuda":
            raise ValueError(f"quantization={self.quantization!r} runs on CPU only (its matmul is a C++ CPU "
                             "kernel); pass device='cpu' or leave quantization unset")
        if self.quantization is not None and self.dtype == "float16":
            raise ValueError(f"quantization={self.quantization!r} needs dtype 'bfloat16', 'float32' or 'auto' "
                             "(its kernel takes bfloat16 or float32 activations), got dtype='float16'")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        check_kv_cache_dtype(self.kv_cache_dtype)
        if self.hf_overrides is not None and not (isinstance(self.hf_overrides, dict)
                                                  and all(isinstance(name, str) for name in self.hf_overrides)):
            raise ValueError(f"hf_overrides must be a dict of HF config fields, got {self.hf_overrides!r}")
        self._check_attention_backend()
        if self.speculative_config is not None:
            self.speculative_config = SpeculativeConfig.from_dict(self.speculative_config)
        self._check_runner()

    def _check_runner(self) -> None:
        if self.runner not in ("generate", "pooling"):
            raise ValueError(f"runner must be 'generate' or 'pooling', got {self.runner!r}")
        if self.runner == "generate" and self.pooler_config is not None:
            raise ValueError("pooler_config is for runner='pooling', which a generating engine is not: "
                             "pass runner='pooling' too, or leave pooler_config unset")
        if self.runner == "pooling" and self.speculative_config is not None:
            raise ValueError("speculative_config drafts tokens, and runner='pooling' generates none: leave it unset")
        if self.pooler_config is not None:
            self.pooler_config = PoolerConfig.from_dict(self.pooler_config)

    def _check_attention_backend(self) -> None:
        """A backend that cannot run here is refused now, with what would make it run."""
        backend, cuda = self.attention_backend, self.torch_device.type == "cuda"
        if backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {backend!r}")
        if self.learner_mode and backend not in ("auto", "torch"):
            raise ValueError(f"learner_mode=True runs the pure-torch attention; attention_backend={backend!r} "
                             "cannot go with it (leave it 'auto')")
        kernels = self.attention_kernels
        if kernels == "flash-attn" and not cuda:
            raise ValueError("attention_backend='flash-attn' needs a CUDA device; on CPU leave it 'auto'")
        if kernels == "flash-attn" and importlib.util.find_spec("flash_attn") is None:
            raise ValueError("attention_backend='flash-attn' but flash-attn is not installed: build it as "
                             "docs/gpu.md says, or pass attention_backend='triton'")
        if kernels == "flash-attn" and self.kv_cache_dtype != "auto":
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} cannot run with flash-attn, whose functions "
                             "read the cache in the model's dtype: pass attention_backend='triton' (or 'auto')")
        if kernels == "flash-attn" and self.dtype == "float32":
            raise ValueError("dtype='float32' cannot run with flash-attn, which takes float16 or bfloat16 "
                             "(attention_backend='triton' takes float32)")
        if (kernels == "triton" or cuda) and importlib.util.find_spec("triton") is None:
            raise ValueError("the CUDA path needs triton (its KV store is a Triton kernel): pip install triton")
        if kernels == "triton" and not cuda and not _triton_interprets():
            raise ValueError("attention_backend='triton' runs on CUDA; on CPU only under Triton's interpreter "
                             "(TRITON_INTERPRET=1, for testing the kernels): leave it 'auto' for the C++ kernels")

    @property
    def attention_kernels(self) -> str:
        """The attention backend in effect: "auto" resolved for the device ("cpu" for the C++ kernels)."""
        if self.learner_mode or self.attention_backend != "auto":
            return "torch" if self.learner_mode else self.attention_backend
        if self.torch_device.type != "cuda":
            return "cpu"
        # An 8-bit cache takes the Triton kernels: flash-attn's read it in the model's dtype only.
        flash_attn = importlib.util.find_spec("flash_attn") is not None and self.kv_cache_dtype == "auto"
        return "flash-attn" if flash_attn else "triton"

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        """bf16 on CUDA; on CPU bf16 only where the cores have native bf16 dot products.

        Measured on an avx512_bf16 machine, bf16 matmuls run about 4x faster than float32;
        without native support bf16 is emulated and slower, so float32 is the fallback.
        """
        if self.dtype != "auto":
            return getattr(torch, self.dtype)
        if self.torch_device.type == "cuda" or torch.cpu._is_avx512_bf16_supported():
            return torch.bfloat16
        return torch.float32

    def resolve_limits(self, model_max_len: int) -> None:
        """Fill in the length defaults that depend on the model."""
        if self.max_model_len is not None and self.max_model_len > model_max_len:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's context length {model_max_len}")
        self.max_model_len_is_default = self.max_model_len is None
        self.max_model_len = self.max_model_len or min(4096, model_max_len)

    def resolve_pooler(self, path: str) -> None:
        """With runner="pooling", the pooler the checkpoint at ``path`` says, under the user's
        pooler_config (pooler.py). MEAN and CLS need the hidden states of every prompt position,
        which a prefix-cache hit does not compute: with them nothing is read back from it (vLLM's rule)."""
        if self.runner != "pooling":
            return
        self.pooler_config = load_pooler_config(path, self.pooler_config)
        if self.pooler_config.pooling_type != "LAST" and self.enable_prefix_caching:
            logger.info("%s pooling needs every prompt position computed: prefix caching is off",
                        self.pooler_config.pooling_type)
            self.enable_prefix_caching = False

    def fit_to_kvcache(self, num_kvcache_blocks: int, block_size: int, sliding_window: int | None = None) -> None:
        """Make sure every admissible sequence can be served by the cache and the token budget.

        A sequence of ``max_model_len`` tokens must fit in the whole KV cache and, unless chunked
        prefill splits it over several steps, in one step's token budget, or it would wait forever.
        When every layer slides (``sliding_window``) and prompts come in chunks, a sequence holds only
        the blocks of its window and its step (block_manager.py): a ``max_model_len`` asked for may
        then pass the cache, which must hold a window and a step instead.
        """
        capacity = num_kvcache_blocks * block_size
        windowed = sliding_window is not None and self.enable_chunked_prefill and not self.max_model_len_is_default
        if self.max_model_len > capacity and not windowed:
            if not self.max_model_len_is_default:
                raise ValueError(f"max_model_len={self.max_model_len} is larger than the whole KV cache "
                                 f"({num_kvcache_blocks} blocks x {block_size} tokens = {capacity} tokens); "
                                 "lower max_model_len or give the cache more blocks")
            self.max_model_len = capacity
        if self.max_num_batched_tokens is None and self.enable_chunked_prefill:
            # Small steps keep running streams' token gaps short, large ones lose less throughput.
            # Measured on 2 CPU cores, float32 (16 streams decoding when 64 prompts arrive): largest
            # gap 4.8-5.8x the median at 512 tokens, 4.0 at 384, 2.6-3.6 at 256; bench.py's workload
            # offline, each against prefill-first run just before it: 512 +3%, +13%; 384 -9%, +1%;
            # 256 0.80-1.14x over five rounds (median 1.03): within this machine's noise. On CUDA,
            # vLLM's online default of 2048.
            # At least one decode token for every sequence a step may hold.
            self.max_num_batched_tokens = max(2048 if self.torch_device.type == "cuda" else 256, self.max_num_seqs)
        elif self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = max(8192, self.max_model_len)
        elif self.max_num_batched_tokens < self.max_model_len and not self.enable_chunked_prefill:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} is smaller than "
                             f"max_model_len={self.max_model_len}: a long prompt could never be scheduled "
                             "(unless enable_chunked_prefill=True splits it)")
        needed = -(-(sliding_window - 1 + self.max_num_batched_tokens) // block_size) + 1 if windowed else 0
        if needed > num_kvcache_blocks - 1:  # the null block is no sequence's
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens}: a step of it and the sliding "
                             f"window of {sliding_window} tokens need {needed} KV blocks, the cache has "
                             f"{num_kvcache_blocks - 1}; lower max_num_batched_tokens or give the cache more blocks")
