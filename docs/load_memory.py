"""What loading a model costs in memory and time, in bf16, int8 and int4 (docs/quantization.md, "Memory").

A model of Llama-3.2-1B's shape (hidden 2048, 16 layers, 8 kv heads, a 49,152-token vocabulary, tied
embeddings) with random weights (``load_format="dummy"``), each load in a fresh process: its peak RSS
(VmHWM) after ``LLM()`` less its peak after importing torch and nanoengine, the bytes the model holds
(parameters and buffers), and the seconds ``LLM()`` took. Usage: ``python docs/load_memory.py``.
"""

import json
import subprocess
import sys
import tempfile

MEASURE = r"""
import json, sys, time
import torch, nanoengine
def peak_rss():
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM:"))
before, start = peak_rss(), time.perf_counter()
llm = nanoengine.LLM(sys.argv[1], load_format="dummy", quantization=json.loads(sys.argv[2]), dtype="bfloat16",
                     device="cpu", num_kvcache_blocks=16, max_model_len=256, enforce_eager=True,
                     skip_tokenizer_init=True)
seconds, growth = time.perf_counter() - start, peak_rss() - before
model = llm.model_runner.model
held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for t in [*model.parameters(), *model.buffers()]}
print(json.dumps({"growth": growth, "held": sum(held.values()), "seconds": seconds}))
"""

if __name__ == "__main__":
    from transformers import LlamaConfig
    with tempfile.TemporaryDirectory() as path:
        LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                    num_key_value_heads=8, vocab_size=49152, tie_word_embeddings=True).save_pretrained(path)
        for fmt in (None, "int8", "int4"):
            out = subprocess.run([sys.executable, "-c", MEASURE, path, json.dumps(fmt)], capture_output=True,
                                 text=True, check=True).stdout
            r = json.loads(out.strip().splitlines()[-1])
            print(f"{fmt or 'bf16'}: peak growth {r['growth'] / 1e9:.2f} GB, model {r['held'] / 1e9:.2f} GB "
                  f"({r['growth'] / r['held']:.2f}x), load {r['seconds']:.1f} s")
