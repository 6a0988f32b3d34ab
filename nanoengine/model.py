"""The decoder: Llama, Qwen2 and Qwen3 in one module, chosen from the HF config.

The three differ in two details: Qwen2 adds a bias to the q/k/v projections, and Qwen3
normalises each query and key head (RMSNorm over head_dim) before the rotary embedding.
Tokens of all sequences in a step are packed into one flat batch, ``[num_tokens, hidden]``:
there is no padding anywhere in the model; the ``Context`` tells attention where sequences start.

With tensor parallelism (``tp``, see linear.py for the splits) a rank holds ``1/size`` of the
attention heads, of the MLP's intermediate features and of the vocabulary. When there are fewer
kv heads than ranks, each kv head is held by ``size / num_kv_heads`` ranks (as in vLLM): a rank
keeps the one kv head its query heads read.
"""

import contextlib

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from transformers import PretrainedConfig

from nanoengine.attention import Attention
from nanoengine.context import Context
from nanoengine.layers import RMSNorm, RotaryEmbedding, SiluAndMul
from nanoengine.linear import PackedLinear, ParallelLMHead, RowParallelLinear, VocabParallelEmbedding
from nanoengine.parallel import Shard, TensorParallelGroup

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")


LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def rotary_embedding(config: PretrainedConfig, max_position: int) -> RotaryEmbedding:
    """The config's rotary embedding: plain RoPE or Llama 3.1's "llama3" scaling; other types are refused
    rather than run as plain RoPE, which would answer wrong past their original context."""
    params = config.rope_parameters  # transformers>=5 fills it (rope_type, rope_theta) for every model
    rope_type = params.get("rope_type", "default")
    if rope_type not in ("default", "llama3"):
        raise ValueError(f"rope type {rope_type!r} (config.rope_parameters) is not supported; "
                         "supported: default, llama3")
    llama3_scaling = {key: params[key] for key in LLAMA3_ROPE_KEYS} if rope_type == "llama3" else None
    return RotaryEmbedding(head_dim(config), max_position, params["rope_theta"], llama3_scaling)


def head_dim(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def check_tensor_parallel_size(config: PretrainedConfig, size: int) -> None:
    """A ``ValueError`` unless the model splits evenly over ``size`` ranks (asked before any rank starts)."""
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if heads % size or (kv_heads % size if kv_heads >= size else size % kv_heads):
        raise ValueError(f"tensor_parallel_size={size} does not split the model's {heads} attention heads "
                         f"({kv_heads} kv heads) evenly: it must divide the attention heads, and divide or be "
                         "a multiple of the kv heads")
    if config.intermediate_size % size:
        raise ValueError(f"tensor_parallel_size={size} does not divide the model's intermediate_size "
                         f"{config.intermediate_size}")


def kv_head_shard(config: PretrainedConfig, tp: TensorParallelGroup | None) -> Shard:
    """The kv heads this rank holds, in rows of k_proj (or v_proj): its share of them, or, with fewer
    kv heads than ranks, the one kv head that its query heads read."""
    total = config.num_key_value_heads
    size, rank = (1, 0) if tp is None else (tp.size, tp.rank)
    d = head_dim(config)
    return Shard(total * d, rank * total // size * d, max(1, total // size) * d)


class DecoderAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, rotary_emb: RotaryEmbedding, tp: TensorParallelGroup | None):
        super().__init__()
        self.head_dim = head_dim(config)
        q_shard = Shard.split(config.num_attention_heads * self.head_dim, tp)
        kv_shard = kv_head_shard(config, tp)
        self.num_heads, self.num_kv_heads = q_shard.size // self.head_dim, kv_shard.size // self.head_dim
        qkv_bias = getattr(config, "attention_bias", config.model_type == "qwen2")
        self.qkv_proj = PackedLinear(config.hidden_size, {"q": q_shard, "k": kv_shard, "v": kv_shard}, bias=qkv_bias)
        o_bias = getattr(config, "attention_bias", False) and config.model_type != "qwen2"
        self.o_proj = RowParallelLinear(q_shard, config.hidden_size, bias=o_bias, tp=tp)
        self.qk_norm = config.model_type == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.rotary_emb = rotary_emb
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, ctx: Context) -> torch.Tensor:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(hidden).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q, k, v, ctx)
        return self.o_proj(out.flatten(1))


class DecoderMLP(nn.Module):
    def __init__(self, config: PretrainedConfig, tp: TensorParallelGroup | None):
        super().__init__()
        shard = Shard.split(config.intermediate_size, tp)
        self.gate_up_proj = PackedLinear(config.hidden_size, {0: shard, 1: shard}, bias=False)
        self.act = SiluAndMul()
        self.down_proj = RowParallelLinear(shard, config.hidden_size, bias=False, tp=tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, rotary_emb: RotaryEmbedding, tp: TensorParallelGroup | None):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DecoderAttention(config, rotary_emb, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DecoderMLP(config, tp)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                ctx: Context) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden is the previous layer's output, residual the running sum before it (None at the
        first layer); each norm adds its input into the sum first. Returns the same pair."""
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden, residual = self.post_attention_layernorm(self.self_attn(positions, hidden, ctx), residual)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    def __init__(self, config: PretrainedConfig, max_position: int, tp: TensorParallelGroup | None):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(Shard.split(config.vocab_size, tp), config.hidden_size, tp)
        # One table of rotary angles, shared by every layer.
        rotary_emb = rotary_embedding(config, max_position)
        self.layers = nn.ModuleList(DecoderLayer(config, rotary_emb, tp) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: Context) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, ctx)
        return self.norm(hidden, residual)[0]


class CausalLM(nn.Module):
    # Checkpoint tensor name fragment -> (fused parameter it goes into, shard id).
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: PretrainedConfig, max_position: int, tp: TensorParallelGroup | None = None):
        super().__init__()
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model type {config.model_type!r} is not supported; "
                             f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        self.model = DecoderModel(config, max_position, tp)
        self.lm_head = ParallelLMHead(Shard.split(config.vocab_size, tp), config.hidden_size, tp)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: Context) -> torch.Tensor:
        """Hidden states of every token in the step, ``[num_tokens, hidden]``."""
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits over the whole vocabulary; with tensor parallelism on rank 0 only (None elsewhere)."""
        return self.lm_head(hidden)


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


def build_model(hf_config: PretrainedConfig, max_position: int, tp: TensorParallelGroup | None,
                device: torch.device, dtype: torch.dtype) -> CausalLM:
    """The model, made directly on ``device`` in ``dtype``, its weights not yet filled (the loader
    fills every one next). RotaryEmbedding's angle table names float32 itself, so it stays float32."""
    with torch.device(device), default_dtype(dtype), skip_weight_init():
        return CausalLM(hf_config, max_position=max_position, tp=tp).eval()
