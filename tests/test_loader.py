"""The loader refuses a checkpoint that does not fit the model, naming the tensor, and reads every EOS id."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from nanoengine import LLM, SamplingParams

CHECKPOINT = "model.safetensors"


def edited_checkpoint(src: str, dst: str, edit) -> str:
    """A copy of the model directory ``src`` whose tensors went through ``edit(tensors)``."""
    shutil.copytree(src, dst)
    tensors = load_file(os.path.join(src, CHECKPOINT))
    edit(tensors)
    save_file(tensors, os.path.join(dst, CHECKPOINT), metadata={"format": "pt"})
    return dst


def drop(name):
    return lambda tensors: tensors.pop(name)


def replace(name, make):
    return lambda tensors: tensors.__setitem__(name, make(tensors[name]))


@pytest.mark.parametrize("edit, match", [
    (drop("model.layers.1.self_attn.v_proj.weight"),  # a fused qkv_proj with one shard absent
     r"lacks tensors \['model\.layers\.1\.self_attn\.v_proj\.weight'\]"),
    (drop("model.norm.weight"), r"lacks tensors \['model\.norm\.weight'\]"),
    (replace("model.layers.0.self_attn.k_proj.weight", lambda t: t[:-1]),
     r"'model\.layers\.0\.self_attn\.k_proj\.weight' has shape \[31, 64\], the model expects \[32, 64\]"),
    (replace("model.layers.0.input_layernorm.weight", lambda t: t[:1]),  # copy_ would broadcast it
     r"'model\.layers\.0\.input_layernorm\.weight' has shape \[1\], the model expects \[64\]"),
    (replace("model.layers.0.mlp.up_proj.weight", lambda t: t.T.contiguous()),
     r"'model\.layers\.0\.mlp\.up_proj\.weight' has shape \[64, 128\], the model expects \[128, 64\]"),
    (lambda tensors: tensors.__setitem__("model.layers.0.self_attn.extra.weight", torch.zeros(2)),
     r"'model\.layers\.0\.self_attn\.extra\.weight' has no place in the model"),
])
def test_checkpoint_that_does_not_fit_raises_naming_the_tensor(tiny_models, tmp_path, edit, match):
    path = edited_checkpoint(tiny_models["llama"], os.fspath(tmp_path / "edited"), edit)
    with pytest.raises(ValueError, match=match):
        LLM(path, dtype="float32", device="cpu")


def test_extra_eos_from_generation_config_stops_generation(tiny_models, tmp_path):
    path = os.fspath(tmp_path / "llama")
    shutil.copytree(tiny_models["llama"], path)
    prompt = [7, 8, 9, 10, 11]
    probe = LLM(path, dtype="float32", device="cpu")
    tokens = probe.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                            use_tqdm=False)[0]["token_ids"]
    # The first token greedy decoding produces that it had not produced before, a few steps in.
    step = next(i for i in range(3, len(tokens)) if tokens[i] not in tokens[:i])
    assert tokens[step] not in probe.scheduler.eos_token_ids
    with open(os.path.join(path, "generation_config.json")) as f:
        generation_config = json.load(f)
    generation_config["eos_token_id"] = [generation_config["eos_token_id"], tokens[step]]
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump(generation_config, f)

    out = LLM(path, dtype="float32", device="cpu").generate(
        [prompt], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    assert out["finish_reason"] == "stop" and out["token_ids"] == tokens[:step + 1]
