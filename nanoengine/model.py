"""The decoder: Llama's, and the families that depart from it in a few named ways.

Llama, Qwen2, Qwen3, Mistral, Gemma 2 and Gemma 3 share this one decoder, and so do the mixtures
of experts (Qwen3-MoE, Mixtral, OLMoE), whose sparse layers take moe.py's MLP; each family's
differences (a bias, q/k norms, a sliding window, Gemma's norms, gate, soft caps and embedding
scale, experts) are read from the HF config by model_families.py into a ``FamilySpec``, which the
modules below take; with Llama's spec they are Llama's decoder. Tokens of all sequences in a step are
packed into one flat batch, ``[num_tokens, hidden]``: there is no padding anywhere in the model;
the ``Context`` tells attention where sequences start.

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

from nanoengine.activation import GeluTanhAndMul, SiluAndMul
from nanoengine.attention import Attention
from nanoengine.context import Context
from nanoengine.layernorm import GemmaRMSNorm, RMSNorm
from nanoengine.linear import PackedLinear, ParallelLMHead, RowParallelLinear, ShardedRMSNorm, VocabParallelEmbedding
from nanoengine.model_families import FamilySpec, LayerSpec, family_spec
from nanoengine.moe import FusedMoE
from nanoengine.parallel import Shard, TensorParallelGroup
from nanoengine.rotary_embedding import RotaryEmbedding

LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
LONGROPE_KEYS = ("short_factor", "long_factor", "original_max_position_embeddings", "attention_factor")


def rotary_embedding(rope: dict, head_dim: int, max_position: int) -> RotaryEmbedding:
    """The rotary embedding of ``rope`` (a layer's ``rope_parameters``, checked by model_families.py):
    plain RoPE, Llama 3.1's "llama3" scaling, "linear" or "longrope", over all of each head or the
    ``partial_rotary_factor`` of it."""
    rope_type = rope.get("rope_type", "default")
    llama3_scaling = {key: rope[key] for key in LLAMA3_ROPE_KEYS} if rope_type == "llama3" else None
    linear_factor = rope["factor"] if rope_type == "linear" else 1.0
    longrope = {key: rope[key] for key in LONGROPE_KEYS} if rope_type == "longrope" else None
    rotary_dim = int(head_dim * rope.get("partial_rotary_factor", 1.0))
    return RotaryEmbedding(head_dim, max_position, rope["rope_theta"], llama3_scaling, linear_factor, longrope,
                           rotary_dim)


def rotary_embeddings(config: PretrainedConfig, spec: FamilySpec, max_position: int) -> list[RotaryEmbedding]:
    """Each layer's rotary embedding: one table of angles per distinct rope (Gemma 3: a local and a
    global one), shared by the layers that use it."""
    tables = {}
    for layer in spec.layers:
        key = tuple(sorted(layer.rope.items()))
        if key not in tables:
            tables[key] = rotary_embedding(layer.rope, head_dim(config), max_position)
    return [tables[tuple(sorted(layer.rope.items()))] for layer in spec.layers]


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
    spec = family_spec(config)
    if spec.moe and spec.moe.intermediate_size % size:
        raise ValueError(f"tensor_parallel_size={size} does not divide the model's experts' intermediate_size "
                         f"{spec.moe.intermediate_size}")


def kv_head_shard(config: PretrainedConfig, tp: TensorParallelGroup | None) -> Shard:
    """The kv heads this rank holds, in rows of k_proj (or v_proj): its share of them, or, with fewer
    kv heads than ranks, the one kv head that its query heads read."""
    total = config.num_key_value_heads
    size, rank = (1, 0) if tp is None else (tp.size, tp.rank)
    d = head_dim(config)
    return Shard(total * d, rank * total // size * d, max(1, total // size) * d)


def norm_class(spec: FamilySpec) -> type[nn.Module]:
    return GemmaRMSNorm if spec.gemma_norms else RMSNorm


class DecoderAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, spec: FamilySpec, layer: LayerSpec, rotary_emb: RotaryEmbedding,
                 tp: TensorParallelGroup | None):
        super().__init__()
        self.head_dim = head_dim(config)
        q_shard = Shard.split(config.num_attention_heads * self.head_dim, tp)
        kv_shard = kv_head_shard(config, tp)
        self.num_heads, self.num_kv_heads = q_shard.size // self.head_dim, kv_shard.size // self.head_dim
        self.qkv_proj = PackedLinear(config.hidden_size, {"q": q_shard, "k": kv_shard, "v": kv_shard},
                                     bias=spec.qkv_bias)
        self.o_proj = RowParallelLinear(q_shard, config.hidden_size, bias=spec.o_bias, tp=tp)
        self.qk_norm, self.qk_norm_whole = spec.qk_norm, spec.qk_norm_whole
        if self.qk_norm_whole and tp is not None:  # OLMoE's norms over all heads, which the ranks share out
            self.q_norm = ShardedRMSNorm(q_shard, config.rms_norm_eps, tp)
            replicas = max(1, tp.size // config.num_key_value_heads)
            self.k_norm = ShardedRMSNorm(kv_shard, config.rms_norm_eps, tp, replicas)
        elif self.qk_norm:  # over each head, or over the whole projection (OLMoE)
            q_width, k_width = (q_shard.size, kv_shard.size) if spec.qk_norm_whole else (self.head_dim, self.head_dim)
            self.q_norm = norm_class(spec)(q_width, config.rms_norm_eps)
            self.k_norm = norm_class(spec)(k_width, config.rms_norm_eps)
        self.rotary_emb = rotary_emb
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, spec.attn_scale, layer.sliding_window,
                              spec.attn_softcap)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, ctx: Context) -> torch.Tensor:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(hidden).split([q_size, kv_size, kv_size], dim=-1)
        if self.qk_norm_whole:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm and not self.qk_norm_whole:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q, k, v, ctx)
        return self.o_proj(out.flatten(1))


class DecoderMLP(nn.Module):
    def __init__(self, config: PretrainedConfig, spec: FamilySpec, tp: TensorParallelGroup | None):
        super().__init__()
        shard = Shard.split(config.intermediate_size, tp)
        self.gate_up_proj = PackedLinear(config.hidden_size, {0: shard, 1: shard}, bias=False)
        self.act = GeluTanhAndMul() if spec.activation == "gelu_tanh" else SiluAndMul()
        self.down_proj = RowParallelLinear(shard, config.hidden_size, bias=False, tp=tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, spec: FamilySpec, layer: LayerSpec, rotary_emb: RotaryEmbedding,
                 tp: TensorParallelGroup | None):
        super().__init__()
        norm = norm_class(spec)
        self.input_layernorm = norm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DecoderAttention(config, spec, layer, rotary_emb, tp)
        self.post_attention_layernorm = norm(config.hidden_size, config.rms_norm_eps)
        self.mlp = FusedMoE(config.hidden_size, spec.moe, tp) if layer.sparse else DecoderMLP(config, spec, tp)
        # Gemma norms each block's output too, before it joins the residual: post_attention_layernorm
        # is then that norm of the attention's output, and pre_feedforward_layernorm the MLP's input norm.
        self.post_norms = spec.gemma_norms
        if self.post_norms:
            self.pre_feedforward_layernorm = norm(config.hidden_size, config.rms_norm_eps)
            self.post_feedforward_layernorm = norm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                ctx: Context) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden is the previous layer's output, residual the running sum before it (None at the
        first layer); each norm adds its input into the sum first. Returns the same pair."""
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, ctx)
        if self.post_norms:
            hidden, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(hidden), residual)
            return self.post_feedforward_layernorm(self.mlp(hidden)), residual
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    def __init__(self, config: PretrainedConfig, spec: FamilySpec, max_position: int, tp: TensorParallelGroup | None):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(Shard.split(config.vocab_size, tp), config.hidden_size, tp)
        # HF scales by sqrt(hidden) rounded to the model's dtype (the default while the model is built).
        self.embed_scale = spec.embed_scale and torch.tensor(spec.embed_scale, dtype=torch.get_default_dtype()).item()
        ropes = rotary_embeddings(config, spec, max_position)
        self.layers = nn.ModuleList(DecoderLayer(config, spec, layer, rope, tp)
                                    for layer, rope in zip(spec.layers, ropes))
        self.norm = norm_class(spec)(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: Context) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        if self.embed_scale:
            hidden = hidden * self.embed_scale
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
        self.spec = spec = family_spec(config)
        self.model = DecoderModel(config, spec, max_position, tp)
        self.final_softcap = spec.final_softcap
        if spec.fused_checkpoint:  # Phi-3's: cut into the names above as they are read (loader.py)
            q, kv = config.num_attention_heads * head_dim(config), config.num_key_value_heads * head_dim(config)
            self.fused_checkpoint_tensors = {"qkv_proj": (("q_proj", q), ("k_proj", kv), ("v_proj", kv)),
                                             "gate_up_proj": (("gate_proj", config.intermediate_size),
                                                              ("up_proj", config.intermediate_size))}
        self.checkpoint_renames = spec.checkpoint_renames  # Mixtral's names for the experts (loader.py)
        self.lm_head = ParallelLMHead(Shard.split(config.vocab_size, tp), config.hidden_size, tp)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: Context) -> torch.Tensor:
        """Hidden states of every token in the step, ``[num_tokens, hidden]``."""
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits over the whole vocabulary; with tensor parallelism on rank 0 only (None elsewhere)."""
        logits = self.lm_head(hidden)
        if self.final_softcap and logits is not None:  # Gemma 2: squashed into (-softcap, softcap)
            logits = self.final_softcap * torch.tanh(logits / self.final_softcap)
        return logits


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
