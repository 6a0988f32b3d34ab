"""roofline.py's bytes and FLOPs equal a hand count from the model's config and the run's lengths."""

import pytest
from transformers import AutoConfig

from nanoengine import LLM, SamplingParams
from nanoengine.roofline import StepCosts, attended_keys, roofline
from nanoengine.trace import StepObserver
from tests.conftest import make_tiny_model


def test_attended_keys_counts_each_querys_keys_within_its_window():
    for window in (None, 1, 3, 8):
        for start in range(12):
            for n in range(1, 12):
                each = [p + 1 if window is None else min(p + 1, window) for p in range(start, start + n)]
                assert attended_keys(start, n, window) == sum(each), (start, n, window)


@pytest.mark.parametrize("arch", ["llama", "mistral"])  # a tied LM head; an untied one and a window of 8
def test_roofline_reads_weights_once_a_decode_step_and_each_sequences_kv_to_its_length(tiny_models, tokenizer,
                                                                                       tmp_path, arch):
    """Two prompts of 5 and 9 tokens, 4 tokens each (EOS ignored): one prefill step of both, then
    3 decode steps at contexts 6 + k and 10 + k; float32 on CPU, so every weight is held as loaded."""
    model = tiny_models.get(arch) or make_tiny_model(str(tmp_path / arch), arch, tokenizer)
    c = AutoConfig.from_pretrained(model)
    llm = LLM(model, dtype="float32", device="cpu", enforce_eager=True)
    observer = StepObserver(llm)
    prompts = [list(range(10, 15)), list(range(20, 29))]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert [r["phase"] for r in observer.records] == ["prefill", "decode", "decode", "decode"]

    h, hd, L, V = c.hidden_size, c.head_dim or c.hidden_size // c.num_attention_heads, c.num_hidden_layers, c.vocab_size
    q, kv = c.num_attention_heads * hd, c.num_key_value_heads * hd
    layer = h * (q + 2 * kv) + q * h + h * 2 * c.intermediate_size + c.intermediate_size * h  # qkv, o, gate_up, down
    window = getattr(c, "sliding_window", None)
    keys = (lambda n: n) if window is None else (lambda n: min(n, window))
    weight_bytes = 4 * (L * (layer + 2 * h) + h + V * h)  # the layers and their norms, the final norm, the LM head
    kv_bytes = 4 * L * 2 * kv * sum(keys(5 + k) + keys(9 + k) for k in (1, 2, 3))
    pairs = sum(keys(p + 1) for length in (5, 9) for p in range(length))
    flops = 2 * L * layer * 14 + 2 * V * h * 2 + L * 4 * q * pairs  # 14 prompt tokens, 2 rows sample

    r = roofline(observer.records, StepCosts.of(llm.model_runner), peak_bandwidth=1e10, peak_flops=1e11)
    assert (r["decode_weight_bytes"], r["decode_kv_bytes"], r["prefill_flops"]) == (3 * weight_bytes, kv_bytes, flops)
    assert r["decode_step_seconds"] == sum(record["seconds"] for record in observer.records[1:])
    assert r["decode_bytes_per_s"] == (3 * weight_bytes + kv_bytes) / r["decode_step_seconds"]
    assert r["decode_bandwidth_fraction"] == r["decode_bytes_per_s"] / 1e10
    assert r["prefill_compute_fraction"] == flops / observer.records[0]["seconds"] / 1e11
