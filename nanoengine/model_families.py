"""What sets each model family apart from Llama's decoder, read from its HF config in one place.

model.py builds one decoder for every family; a ``FamilySpec`` names the few ways a family departs
from Llama's, and ``family_spec`` reads them from the HF config, once, at load. Anything in a config
that nanoengine does not implement (an unknown architecture, rope type, activation or layer type)
is a ``ValueError`` naming it here, before any weight is read, rather than a model that runs and
answers wrong. A new family is a function of a few lines below and an entry in ``FAMILIES``.

- Qwen2: a bias on the q/k/v projections. Qwen3: RMSNorm over each query and key head.
- Mistral: Llama with a sliding window (every layer's, or as ``layer_types`` says).
- Gemma 2: embeddings scaled by sqrt(hidden); RMSNorm scaling by (1 + weight), and a norm after
  attention and after the MLP as well as before (four a layer); a GeLU-tanh gate; attention scores
  and final logits soft-capped; the softmax scale from ``query_pre_attn_scalar``; sliding and full
  layers alternating (``layer_types``).
- Gemma 3: Gemma 2 without the soft caps, with q/k norms, and a rotary base per layer type
  (``rope_parameters["sliding_attention"]``, the local base, and ``["full_attention"]``, the global
  one with its scaling).
- Phi-3 (and Phi-4-mini): Mistral's decoder whose checkpoint fuses q/k/v into ``qkv_proj`` and
  gate/up into ``gate_up_proj`` (the loader cuts them apart), with LongRoPE and partial rotary.
- Mixtures of experts (moe.py in place of the MLP, ``MoESpec``): Qwen3-MoE is Qwen3 whose layers
  are sparse where ``mlp_only_layers`` and ``decoder_sparse_step`` say, renormalizing the top-k
  weights if ``norm_topk_prob``; Mixtral is Mistral whose every layer is sparse, always renormalizing
  its top 2, its checkpoint naming the block ``block_sparse_moe`` and an expert's projections w1
  (gate), w3 (up), w2 (down); OLMoE is Llama with an RMSNorm over the whole q and k projections
  (all heads at once) and sparse layers.
"""

import math
from dataclasses import dataclass, replace
from typing import Callable

from transformers import PretrainedConfig

ROPE_TYPES = ("default", "llama3", "linear", "longrope")
LAYER_TYPES = ("full_attention", "sliding_attention")
GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")  # two names of one function: GeLU, tanh approximation


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer's attention: its sliding window (HF's ``sliding_window``: a query sees itself
    and the window - 1 keys before it; None: every key) and its rotary embedding's ``rope_parameters``."""
    sliding_window: int | None
    rope: dict
    sparse: bool = False  # its MLP is the mixture of experts ``FamilySpec.moe`` describes


@dataclass(frozen=True)
class MoESpec:
    """A mixture of experts (moe.py): ``num_experts`` gated MLPs of ``intermediate_size`` features,
    of which a router picks ``top_k`` for each token; their weights are renormalized to sum to 1 if
    ``renormalize`` (HF's ``norm_topk_prob``), else kept as the softmax over all experts gave them."""
    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool


@dataclass(frozen=True)
class FamilySpec:
    """How a model departs from Llama's decoder; the defaults are Llama's."""
    layers: tuple[LayerSpec, ...]
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False  # RMSNorm over each query and key head before the rotary embedding
    qk_norm_whole: bool = False  # with qk_norm: over the whole q (k) projection, all heads at once (OLMoE)
    gemma_norms: bool = False  # norms scale by (1 + weight); attention and MLP outputs are normed too
    activation: str = "silu"  # of the gated MLP: "silu" or "gelu_tanh"
    embed_scale: float | None = None  # embeddings multiplied by it (in the model's dtype, as HF does)
    attn_softcap: float = 0.0  # attention scores capped at softcap * tanh(score / softcap)
    final_softcap: float = 0.0  # the same for the logits
    attn_scale: float | None = None  # the softmax scale; None: head_dim ** -0.5
    fused_checkpoint: bool = False  # the checkpoint holds qkv_proj and gate_up_proj whole (Phi-3)
    moe: MoESpec | None = None  # the experts of the layers marked sparse
    checkpoint_renames: tuple[tuple[str, str], ...] = ()  # checkpoint name fragment -> ours (Mixtral's)

    @property
    def kv_sliding_window(self) -> int | None:
        """If every layer slides, the largest window: no layer reads a key further back, so the block
        manager releases the blocks behind it. None when some layer reads every key (Llama's, and
        the full layers of a hybrid such as Gemma 2 and 3)."""
        windows = [layer.sliding_window for layer in self.layers]
        return None if None in windows else max(windows)


def check_rope(config: PretrainedConfig, rope: dict, field: str) -> dict:
    """``rope`` (a ``rope_parameters``) if nanoengine runs its type; for "longrope", completed as HF
    completes it (its attention factor from the context's growth), its factor lists made tuples."""
    rope_type = rope.get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} ({field}) is not supported; supported: {', '.join(ROPE_TYPES)}")
    if rope_type != "longrope":
        return rope
    original = rope.get("original_max_position_embeddings") or config.original_max_position_embeddings
    factor = rope.get("factor") or config.max_position_embeddings / original
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return rope | {"short_factor": tuple(rope["short_factor"]), "long_factor": tuple(rope["long_factor"]),
                   "original_max_position_embeddings": original, "attention_factor": attention_factor}


def layer_windows(config: PretrainedConfig) -> list[int | None]:
    """Each layer's sliding window: ``layer_types`` where the config has them, else ``sliding_window``
    for every layer (Mistral's configs) or for none."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None) or ["sliding_attention" if window else "full_attention"] * (
        config.num_hidden_layers)
    for layer_type in layer_types:
        if layer_type not in LAYER_TYPES:
            raise ValueError(f"layer type {layer_type!r} (config.layer_types) is not supported; supported: "
                             f"{', '.join(LAYER_TYPES)}")
    if "sliding_attention" in layer_types and not window:
        raise ValueError("config.layer_types has sliding layers but config.sliding_window is not set")
    return [window if layer_type == "sliding_attention" else None for layer_type in layer_types]


def llama(config: PretrainedConfig) -> FamilySpec:
    rope = check_rope(config, config.rope_parameters, "config.rope_parameters")
    # Llama's configs have attention_bias (one for all four projections); Qwen2's have none.
    bias = getattr(config, "attention_bias", False)
    return FamilySpec(layers=tuple(LayerSpec(None, rope) for _ in range(config.num_hidden_layers)),
                      qkv_bias=bias, o_bias=bias)


def qwen2(config: PretrainedConfig) -> FamilySpec:
    return replace(llama(config), qkv_bias=True, o_bias=False)


def qwen3(config: PretrainedConfig) -> FamilySpec:
    return replace(llama(config), qk_norm=True)


def mistral(config: PretrainedConfig) -> FamilySpec:
    spec = llama(config)
    return replace(spec, layers=tuple(LayerSpec(window, layer.rope)
                                      for window, layer in zip(layer_windows(config), spec.layers)))


def gemma2(config: PretrainedConfig) -> FamilySpec:
    if config.hidden_activation not in GELU_TANH:
        raise ValueError(f"hidden_activation {config.hidden_activation!r} (config.hidden_activation) is not "
                         f"supported; supported: {', '.join(GELU_TANH)}")
    return replace(mistral(config), gemma_norms=True, activation="gelu_tanh", embed_scale=config.hidden_size ** 0.5,
                   attn_softcap=config.attn_logit_softcapping or 0.0,
                   final_softcap=config.final_logit_softcapping or 0.0,
                   attn_scale=config.query_pre_attn_scalar ** -0.5)


def gemma3_text(config: PretrainedConfig) -> FamilySpec:
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError("config.use_bidirectional_attention=True (an encoder's attention) is not supported")
    ropes = {name: check_rope(config, config.rope_parameters[name], f"config.rope_parameters[{name!r}]")
             for name in LAYER_TYPES}
    layers = tuple(LayerSpec(window, ropes["sliding_attention" if window else "full_attention"])
                   for window in layer_windows(config))
    return replace(gemma2(config), layers=layers, qk_norm=True)


def phi3(config: PretrainedConfig) -> FamilySpec:
    if config.hidden_act != "silu":
        raise ValueError(f"hidden_act {config.hidden_act!r} (config.hidden_act) is not supported; supported: silu")
    return replace(mistral(config), fused_checkpoint=True)


def with_experts(config: PretrainedConfig, spec: FamilySpec, intermediate_size: int, renormalize: bool,
                 sparse: Callable[[int], bool] = lambda layer: True) -> FamilySpec:
    """``spec`` with a mixture of experts in the layers ``sparse`` picks (by index)."""
    if config.hidden_act != "silu":
        raise ValueError(f"hidden_act {config.hidden_act!r} (config.hidden_act) is not supported; supported: silu")
    if not 0 < config.num_experts_per_tok <= config.num_experts:
        raise ValueError(f"config.num_experts_per_tok={config.num_experts_per_tok} must be between 1 and "
                         f"config.num_experts={config.num_experts}")
    layers = tuple(replace(layer, sparse=sparse(i)) for i, layer in enumerate(spec.layers))
    return replace(spec, layers=layers, moe=MoESpec(config.num_experts, config.num_experts_per_tok,
                                                    intermediate_size, renormalize))


def qwen3_moe(config: PretrainedConfig) -> FamilySpec:
    def sparse(layer: int) -> bool:  # HF's Qwen3MoeDecoderLayer's rule
        return (layer not in config.mlp_only_layers and config.num_experts > 0
                and (layer + 1) % config.decoder_sparse_step == 0)
    return with_experts(config, qwen3(config), config.moe_intermediate_size, config.norm_topk_prob, sparse)


def mixtral(config: PretrainedConfig) -> FamilySpec:
    renames = (("block_sparse_moe", "mlp"), ("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))
    return replace(with_experts(config, mistral(config), config.intermediate_size, renormalize=True),
                   checkpoint_renames=renames)


def olmoe(config: PretrainedConfig) -> FamilySpec:
    if config.clip_qkv is not None:
        raise ValueError(f"config.clip_qkv={config.clip_qkv} (q/k/v clamped) is not supported; it must be null")
    return replace(with_experts(config, llama(config), config.intermediate_size, config.norm_topk_prob),
                   qk_norm=True, qk_norm_whole=True)


# HF model_type -> its spec, and the architecture name (for messages and the README).
FAMILIES: dict[str, tuple[str, Callable[[PretrainedConfig], FamilySpec]]] = {
    "llama": ("LlamaForCausalLM", llama),
    "qwen2": ("Qwen2ForCausalLM", qwen2),
    "qwen3": ("Qwen3ForCausalLM", qwen3),
    "mistral": ("MistralForCausalLM", mistral),
    "gemma2": ("Gemma2ForCausalLM", gemma2),
    "gemma3_text": ("Gemma3ForCausalLM", gemma3_text),
    "phi3": ("Phi3ForCausalLM", phi3),
    "qwen3_moe": ("Qwen3MoeForCausalLM", qwen3_moe),
    "mixtral": ("MixtralForCausalLM", mixtral),
    "olmoe": ("OlmoeForCausalLM", olmoe),
}


def family_spec(config: PretrainedConfig) -> FamilySpec:
    """The spec of ``config``'s family, or a ValueError naming what nanoengine does not run."""
    if config.model_type not in FAMILIES:
        architectures = ", ".join(getattr(config, "architectures", None) or []) or "no architectures given"
        raise ValueError(f"model type {config.model_type!r} ({architectures}) is not supported; supported: "
                         + ", ".join(f"{name} ({model_type})" for model_type, (name, _) in FAMILIES.items()))
    return FAMILIES[config.model_type][1](config)
