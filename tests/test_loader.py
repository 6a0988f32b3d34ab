"""The loader refuses a checkpoint that does not fit the model, naming the tensor, reads every EOS id,
and converts a GGUF file once into a cache it trusts only when whole."""

import json
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from nanoengine import LLM, SamplingParams, loader
from nanoengine.loader import checkpoint_directory, load_eos_token_ids, load_hf_config, resolve_model_path

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
    (replace("model.norm.weight", lambda t: t.to(torch.int8)), r"'model\.norm\.weight' has dtype I8"),
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


def test_gguf_conversion_gives_what_transformers_reads_from_the_file(tokenizer):
    """The cached directory the engine loads holds the same config, tokenizer, chat template and
    weights, bit for bit, as transformers reading the default GGUF file itself."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    gguf = resolve_model_path(None)
    cached = checkpoint_directory(gguf)
    directory, name = os.path.split(gguf)
    expected_config = AutoConfig.from_pretrained(directory, gguf_file=name)
    # Every field but where it was read from and use_cache (a generation setting, which the base
    # class load_hf_config reads a conversion with leaves to generation_config; nanoengine reads neither).
    config = load_hf_config(cached)
    for field, value in expected_config.to_dict().items():
        if field not in ("_name_or_path", "use_cache"):
            assert getattr(config, field) == value, field
    expected_tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    chat = expected_tokenizer.apply_chat_template([{"role": "user", "content": "Hi there!"}], tokenize=False,
                                                  add_generation_prompt=True)
    assert chat.startswith("<|im_start|>") and tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi there!"}], tokenize=False, add_generation_prompt=True) == chat
    for text in [chat, "Hello, world!", "  spaces\tand\nnewlines ", "naïve café 東京 🙂", "<|im_end|>"]:
        assert tokenizer.encode(text) == expected_tokenizer.encode(text), text
        assert tokenizer.decode(tokenizer.encode(text)) == expected_tokenizer.decode(expected_tokenizer.encode(text))
    assert len(tokenizer) == len(expected_tokenizer)
    assert tokenizer.all_special_tokens == expected_tokenizer.all_special_tokens
    assert (load_eos_token_ids(cached, load_hf_config(cached), tokenizer)
            == load_eos_token_ids(gguf, expected_config, expected_tokenizer) == {2})
    expected = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).state_dict()
    weights = load_file(os.path.join(cached, CHECKPOINT))
    assert set(weights) == set(expected) - {"lm_head.weight"}  # tied: the embedding, stored once
    for tensor_name, tensor in weights.items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, expected[tensor_name]), tensor_name


def fake_conversion(calls: list, delay: float = 0.0):
    """Stands in for the slow conversion of a real GGUF file: writes two files, counting its calls."""
    def convert(path, directory):
        calls.append(path)
        time.sleep(delay)
        (directory / "config.json").write_text('{"model_type": "llama"}')
        (directory / "model.safetensors").write_bytes(b"weights" * 1000)
    return convert


@pytest.fixture
def gguf_file(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", os.fspath(tmp_path / "cache"))
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF" + bytes(range(256)))
    return os.fspath(path)


def test_a_gguf_file_is_converted_once_then_loaded_from_the_cache(gguf_file, monkeypatch):
    calls = []
    monkeypatch.setattr(loader, "_convert_gguf", fake_conversion(calls))
    first = checkpoint_directory(gguf_file)
    assert checkpoint_directory(gguf_file) == first and len(calls) == 1
    assert sorted(os.listdir(os.path.dirname(first))) == [os.path.basename(first)]  # no temporary left
    with open(gguf_file, "ab") as f:  # a file changed in place is a new model
        f.write(b"more")
    assert checkpoint_directory(gguf_file) != first and len(calls) == 2


def test_a_gguf_file_edited_in_its_middle_is_converted_again(tmp_path, monkeypatch):
    """The cache key reads only the file's ends, but an edit anywhere moves its mtime."""
    monkeypatch.setenv("XDG_CACHE_HOME", os.fspath(tmp_path / "cache"))
    calls = []
    monkeypatch.setattr(loader, "_convert_gguf", fake_conversion(calls))
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF" + bytes(3 * loader.FINGERPRINT_BYTES))
    first = checkpoint_directory(os.fspath(path))
    mtime = path.stat().st_mtime_ns
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        f.write(b"\x01")
    os.utime(path, ns=(mtime + 10**9, mtime + 10**9))  # as the clock has moved on by the next write
    assert checkpoint_directory(os.fspath(path)) != first and len(calls) == 2


@pytest.mark.parametrize("damage", [
    lambda d: (d / "model.safetensors").write_bytes(b"weights" * 500),  # truncated
    lambda d: (d / "model.safetensors").write_bytes(b"WEIGHTS" * 1000),  # same size, other bytes
    lambda d: (d / "config.json").unlink(),
    lambda d: (d / loader._MANIFEST).unlink(),  # as a conversion stopped before it vouched for its files
    lambda d: (d / loader._MANIFEST).write_text("{"),
])
def test_a_damaged_cache_is_converted_again_not_trusted(gguf_file, monkeypatch, damage):
    calls = []
    monkeypatch.setattr(loader, "_convert_gguf", fake_conversion(calls))
    directory = Path(checkpoint_directory(gguf_file))
    damage(directory)
    assert checkpoint_directory(gguf_file) == os.fspath(directory) and len(calls) == 2
    assert (directory / "model.safetensors").read_bytes() == b"weights" * 1000
    assert sorted(os.listdir(directory.parent)) == [directory.name]


def test_a_failed_conversion_leaves_nothing_behind(gguf_file, monkeypatch):
    def convert(path, directory):
        (directory / "config.json").write_text("{}")
        raise RuntimeError("unsupported GGUF architecture")
    monkeypatch.setattr(loader, "_convert_gguf", convert)
    with pytest.raises(RuntimeError, match="unsupported"):
        checkpoint_directory(gguf_file)
    assert os.listdir(os.path.join(os.environ["XDG_CACHE_HOME"], "nanoengine")) == []


def test_concurrent_first_loads_each_get_a_whole_conversion(gguf_file, monkeypatch):
    calls = []
    monkeypatch.setattr(loader, "_convert_gguf", fake_conversion(calls, delay=0.2))
    with ThreadPoolExecutor(4) as pool:
        directories = list(pool.map(lambda _: checkpoint_directory(gguf_file), range(4)))
    assert len(set(directories)) == 1 and len(calls) == 4  # all raced; one rename won
    assert sorted(os.listdir(directories[0])) == ["config.json", "model.safetensors", loader._MANIFEST]
    assert sorted(os.listdir(os.path.dirname(directories[0]))) == [os.path.basename(directories[0])]


def test_a_truncated_checkpoint_raises_naming_the_tensor_cut_short(tiny_models, tmp_path):
    path = tmp_path / "truncated"
    shutil.copytree(tiny_models["llama"], path)
    with open(path / CHECKPOINT, "r+b") as f:
        f.truncate(os.path.getsize(path / CHECKPOINT) - 4)
    with pytest.raises(ValueError, match=r"checkpoint tensor '.+' is cut short"):
        LLM(os.fspath(path), dtype="float32", device="cpu")


@pytest.mark.parametrize("name", ["qwen3-0.6b", "llama-3.2-1b"])
def test_dummy_weights_run_a_real_models_shapes_from_its_config_alone(name, tmp_path):
    """``load_format="dummy"`` needs only config.json (tests/data keeps real models'; cut to 2 layers
    here to stay fast), and ``skip_tokenizer_init`` runs token-id prompts with no tokenizer."""
    config = json.loads((Path(__file__).parent / "data" / name / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2}))
    with pytest.raises(ValueError, match="skip_tokenizer_init=True"):
        LLM(str(tmp_path), load_format="dummy", dtype="float32", device="cpu")
    llm = LLM(str(tmp_path), load_format="dummy", skip_tokenizer_init=True, dtype="float32", device="cpu",
              max_model_len=64)
    weights = torch.cat([p.detach().flatten() for p in llm.model_runner.model.parameters()])
    assert weights.abs().max() <= 1e-3 and weights.std() > 1e-4  # vLLM's dummy range, really random
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    assert len(out["token_ids"]) == 3 and out["text"] is None
    for bad in (lambda: llm.generate(["text"], SamplingParams(), use_tqdm=False),
                lambda: llm.generate([[1]], SamplingParams(stop=["x"]), use_tqdm=False),
                lambda: llm.chat([{"role": "user", "content": "hi"}], SamplingParams(), use_tqdm=False)):
        with pytest.raises(ValueError, match="skip_tokenizer_init=True"):
            bad()
    with pytest.raises(ValueError, match="load_format"):
        LLM(str(tmp_path), load_format="npz", skip_tokenizer_init=True)
