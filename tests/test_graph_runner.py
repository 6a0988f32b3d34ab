"""The decode graph runner: padding a batch up to its bucket changes nothing a real row sees, and a
replayed graph computes what the step it recorded would compute on the new inputs.

On CPU the runner records CPU graphs (cpu_graph.py) over its static buffers, so these tests run
the same bucketing, padding and buffer copies a GPU runs.
Each step is compared against a plain eager forward on the same KV cache, restored in between,
and the cache writes are checked slot by slot: the runner must write exactly the real rows'
slots, even when its buffers hold stale slots from a larger batch before. With a GPU, the same
comparison runs on real CUDA graphs, a whole greedy generation is checked against HF
transformers, and the KV cache sizing is checked against gpu_memory_utilization.
"""

import pytest
import torch

from nanoengine import cpu_int8_gemm, cpu_kernels
from nanoengine.cpu_graph import CPUGraph, GraphCaptureError, ReplayError
from nanoengine.cpu_library import KernelCall
from nanoengine.engine import LLMEngine
from nanoengine.graph_runner import CPU_GRAPH_MAX_BATCH, DecodeGraphRunner, decode_buckets
from nanoengine.layernorm import RMSNorm
from nanoengine.llm import LLM
from nanoengine.sampling_params import SamplingParams
from tests.conftest import OracleProposer

MAX_NUM_SEQS = 24
BATCH_SIZES = [17, 9, 3, 16, 1, 8]  # on and between buckets; big before small leaves stale rows behind


def test_buckets_are_powers_of_two_to_8_then_steps_of_16_and_always_the_maximum():
    assert decode_buckets(1) == [1]
    assert decode_buckets(3) == [1, 2, 3]
    assert decode_buckets(8) == [1, 2, 4, 8]
    assert decode_buckets(24) == [1, 2, 4, 8, 16, 24]
    assert decode_buckets(48) == [1, 2, 4, 8, 16, 32, 48]
    assert decode_buckets(256) == [1, 2, 4, 8, *range(16, 257, 16)]


def decoding_engine(model: str, num_seqs: int, **kwargs):
    """An engine whose ``num_seqs`` sequences (prompts of mixed lengths) are prefilled and
    scheduled for a decode step; returns it and those sequences."""
    engine = LLMEngine(model, max_num_seqs=MAX_NUM_SEQS, **kwargs)
    gen = torch.Generator().manual_seed(0)
    for i in range(num_seqs):
        prompt = torch.randint(0, engine.vocab_size, (1 + 3 * i,), generator=gen).tolist()
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert len(engine.step()) == num_seqs  # the prefill
    seqs = engine.scheduler.schedule().seqs
    assert all(seq.is_decode for seq in seqs) and len(seqs) == num_seqs
    return engine, seqs


def changed_slots(before: torch.Tensor, after: torch.Tensor) -> set[int]:
    """Cache slots (block_id * block_size + offset) whose K or V changed in any layer."""
    changed = (before != after).flatten(4).any(-1)  # [2, layers, blocks, block_size]
    return set(changed.any(0).any(0).flatten().nonzero().flatten().tolist())


def check_runner_matches_eager(engine: LLMEngine, seqs, graph_runner: DecodeGraphRunner, tol: dict) -> None:
    runner = engine.model_runner
    before = runner.kv_cache.clone()  # after prefill: this step's slots are still empty
    for n in BATCH_SIZES:
        input_ids, positions, ctx = runner.prepare_decode(seqs[:n])
        with torch.inference_mode():
            runner.kv_cache.copy_(before)
            out = graph_runner.run(input_ids, positions, ctx).clone()
            graph_cache = runner.kv_cache.clone()
            runner.kv_cache.copy_(before)
            expected = runner.model(input_ids, positions, ctx)
        assert out.shape == expected.shape
        torch.testing.assert_close(out, expected, **tol)
        assert changed_slots(before, graph_cache) == set(ctx.slot_mapping.tolist()), f"batch of {n}"
        torch.testing.assert_close(graph_cache, runner.kv_cache, **tol)


@pytest.mark.parametrize("arch,quantization", [("llama", None), ("llama", "int4"), ("qwen2", "int8"),
                                               ("qwen3", None)])
def test_runner_matches_eager_decode_and_writes_only_real_rows(tiny_models, arch, quantization, monkeypatch):
    # Quantized layers on the C++ kernel at every batch size: from cpu_int8_gemm.py's rows on they take
    # the int8 GEMM, which rounds x differently, and a bucket's padded batch may cross that line where
    # the eager one does not (graphs through the GEMM: tests/test_int8_gemm.py).
    monkeypatch.setattr(cpu_int8_gemm, "gemm_min_rows", lambda fmt: None)
    engine, seqs = decoding_engine(tiny_models[arch], max(BATCH_SIZES), dtype="float32", device="cpu",
                                   max_model_len=64, kvcache_block_size=4, quantization=quantization)
    runner = engine.model_runner
    graph_runner = DecodeGraphRunner(runner.model, MAX_NUM_SEQS, 64 // 4, 64, runner.device, runner.dtype,
                                     use_graphs=True)
    assert graph_runner.buckets == [1, 2, 4, 8, 16, 24] and not graph_runner.graphs
    # Equal up to float32 round-off, not bit for bit: a GEMM over 16 rows may block its sums
    # differently from one over 9, and the runner's full-width block table makes attention reduce
    # over more (masked) keys. A leak from a padded row would be off by O(1), not O(1e-6).
    # Each batch's first run records its bucket's graph and the second replays it.
    check_runner_matches_eager(engine, seqs, graph_runner, dict(atol=1e-5, rtol=1.3e-6))
    assert sorted(graph_runner.graphs) == [(1, 1), (4, 1), (8, 1), (16, 1), (24, 1)]


def test_cpu_graph_replays_kernels_and_torch_ops_on_new_inputs():
    x, weight = torch.randn(3, 8), torch.randn(4)
    graph = CPUGraph()
    with torch.inference_mode(), graph.capture():
        hidden = cpu_kernels.silu_and_mul(x)  # C++ kernels, one taking a float and a null pointer
        normed = cpu_kernels.add_rms_norm(hidden, None, weight, eps=0.25)
        out = (normed * 2).add_(1)  # a new tensor (replayed through mul's out=) and an in-place op
    # The two kernel calls are replayed from C++, in one call; their words carry the float and the null.
    assert len(graph.calls) == 4 and len(graph.program) == 3
    x.copy_(torch.randn(3, 8))
    graph.replay()
    gate, up = x.chunk(2, dim=-1)
    expected = torch.nn.functional.rms_norm(torch.nn.functional.silu(gate) * up, (4,), weight, eps=0.25)
    torch.testing.assert_close(out, expected * 2 + 1)


def test_cpu_graph_capture_refuses_what_replay_would_not_repeat():
    x = torch.randn(4)
    with pytest.raises(GraphCaptureError, match="item"), CPUGraph().capture():
        x.sum().item()  # the Python using the value is not replayed
    with pytest.raises(GraphCaptureError, match="shape from its input's values"), CPUGraph().capture():
        x[x > 0]
    with pytest.raises(GraphCaptureError, match="no out= form"), CPUGraph().capture():
        x.sort()


def test_runner_decodes_eagerly_after_a_refused_capture(tiny_models, monkeypatch):
    engine, seqs = decoding_engine(tiny_models["llama"], max(BATCH_SIZES), dtype="float32", device="cpu",
                                   max_model_len=64, kvcache_block_size=4)
    runner = engine.model_runner
    forward = RMSNorm.forward

    def reads_a_value(self, x, residual=None):
        x.sum().item()
        return forward(self, x, residual)
    monkeypatch.setattr(RMSNorm, "forward", reads_a_value)
    graph_runner = DecodeGraphRunner(runner.model, MAX_NUM_SEQS, 64 // 4, 64, runner.device, runner.dtype,
                                     use_graphs=True)
    with pytest.warns(RuntimeWarning, match="CPU graph capture failed, so decode runs eagerly.*item"):
        check_runner_matches_eager(engine, seqs, graph_runner, dict(atol=1e-5, rtol=1.3e-6))
    assert not graph_runner.graphs and not graph_runner.records_cpu_graphs


def test_replayed_kernel_that_refuses_an_index_raises_value_error(tiny_models):
    engine, seqs = decoding_engine(tiny_models["llama"], 1, dtype="float32", device="cpu",
                                   max_model_len=64, kvcache_block_size=4)
    runner = engine.model_runner
    input_ids, positions, ctx = runner.prepare_decode(seqs)
    with torch.inference_mode():
        expected = runner.graph_runner.run(input_ids, positions, ctx).clone()  # records bucket 1
        block_tables = ctx.block_tables
        ctx.block_tables = torch.full_like(block_tables, runner.num_kvcache_blocks)  # one past the cache
        runner.graph_runner.block_tables[0] = runner.num_kvcache_blocks
        with pytest.raises(ReplayError, match="decode_float32 refused its arguments"):
            runner.graph_runner.graphs[1, 1].replay()
        with pytest.raises(ValueError, match="block_table holds values outside"):
            runner.graph_runner.run(input_ids, positions, ctx)
        ctx.block_tables = block_tables
        torch.testing.assert_close(runner.graph_runner.run(input_ids, positions, ctx), expected)


def test_cpu_graphs_stop_at_their_batch_size_cap(tiny_models):
    llm = LLM(tiny_models["llama"], max_num_seqs=CPU_GRAPH_MAX_BATCH + 8, max_model_len=64)
    graph_runner = llm.model_runner.graph_runner
    prompts = [[i + 1, i + 2] for i in range(CPU_GRAPH_MAX_BATCH + 8)]
    # Decode steps of 40 sequences, then (8 done) of 32.
    params = [SamplingParams(temperature=0, max_tokens=3 if i < 8 else 5, ignore_eos=True) for i in range(len(prompts))]
    llm.generate(prompts, params, use_tqdm=False)
    assert sorted(graph_runner.graphs) == [(CPU_GRAPH_MAX_BATCH, 1)]  # the bucket of 40 decoded eagerly


@pytest.mark.parametrize("arch,kwargs", [("llama", {}), ("llama", {"quantization": "int4"}),
                                         ("qwen2", {"dtype": "bfloat16"}), ("qwen3", {})])
def test_cpu_graphs_generate_the_same_tokens_as_eager_decode(tiny_models, arch, kwargs):
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 1000, (n,), generator=gen).tolist() for n in (3, 17, 40, 5, 9)]
    params = [SamplingParams(temperature=0, max_tokens=12 + 3 * i, ignore_eos=True) for i in range(len(prompts))]
    outputs = {}
    for eager in (False, True):
        llm = LLM(tiny_models[arch], max_model_len=128, enforce_eager=eager, **kwargs)
        outputs[eager] = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
        assert (llm.model_runner.graph_runner is None) == eager
    assert outputs[False] == outputs[True]


def test_failed_graph_capture_warns_and_decodes_eagerly(tiny_models, monkeypatch):
    """A kernel that syncs with the host makes capture raise; the engine must not crash on it."""
    class FailingGraph:
        def __init__(self):
            raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(torch.cuda, "CUDAGraph", FailingGraph)
    engine, seqs = decoding_engine(tiny_models["llama"], max(BATCH_SIZES), dtype="float32", device="cpu",
                                   max_model_len=64, kvcache_block_size=4)
    runner = engine.model_runner
    graph_runner = DecodeGraphRunner(runner.model, MAX_NUM_SEQS, 64 // 4, 64, runner.device, runner.dtype,
                                     use_graphs=False)
    with pytest.warns(RuntimeWarning, match="graph capture failed, so decode runs eagerly.*stream is capturing"):
        graph_runner._capture_cuda_graphs()  # what a CUDA runner calls at start-up
    assert not graph_runner.graphs
    check_runner_matches_eager(engine, seqs, graph_runner, dict(atol=1e-5, rtol=1.3e-6))


# -- on a GPU ---------------------------------------------------------------------------------------

BF16_TOL = dict(atol=2e-2, rtol=2e-2)


@pytest.fixture(params=["flash-attn", "triton"])
def cuda_backend(request) -> str:
    """Each CUDA attention backend; flash-attn only where it is installed."""
    if request.param == "flash-attn":
        pytest.importorskip("flash_attn")
    return request.param


@pytest.mark.cuda
def test_cuda_graph_replay_matches_eager(tiny_models, cuda_backend):
    engine, seqs = decoding_engine(tiny_models["llama"], max(BATCH_SIZES), dtype="bfloat16", device="cuda",
                                   num_kvcache_blocks=64, attention_backend=cuda_backend)
    graph_runner = engine.model_runner.graph_runner
    assert graph_runner.buckets == [1, 2, 4, 8, 16, 24]  # captured at start-up, one token a sequence
    assert sorted(graph_runner.graphs) == [(b, 1) for b in graph_runner.buckets]
    check_runner_matches_eager(engine, seqs, graph_runner, BF16_TOL)


@pytest.mark.cuda
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_cuda_greedy_generation_agrees_with_hf_in_bf16(tiny_models, arch, cuda_backend):
    """Every greedy token is HF's argmax on the same prefix, or within a bf16 near-tie of it.

    Two prompts share a 300-token prefix, so the second prefill reads at least 256 tokens (a
    flash-attn block, or 16 of Triton's) back from the prefix cache through the paged varlen path.
    """
    from transformers import AutoModelForCausalLM
    llm = LLM(tiny_models[arch], dtype="bfloat16", device="cuda", attention_backend=cuda_backend,
              num_kvcache_blocks=32 if cuda_backend == "flash-attn" else 512)
    # Ids within the tiny vocabulary: SmolLM2's, or on a machine without it conftest's small one.
    gen, vocab = torch.Generator().manual_seed(1), min(1000, llm.vocab_size)
    shared = torch.randint(0, vocab, (300,), generator=gen).tolist()
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (5, 40, 270)]
    prompts += [shared + [1, 2, 3], shared + [4, 5]]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    assert llm.stats()["prefix_cache_hit_tokens"] >= 256
    hf = AutoModelForCausalLM.from_pretrained(tiny_models[arch], dtype=torch.bfloat16).cuda().eval()
    for prompt, output in zip(prompts, outputs):
        completion = output["token_ids"]
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + completion[:-1]], device="cuda")).logits[0, len(prompt) - 1:].float()
        chosen = logits.gather(1, torch.tensor(completion, device="cuda")[:, None])[:, 0]
        margin = 0.02 * logits.abs().amax(1)  # bf16 keeps ~3 significant digits
        assert (logits.amax(1) - chosen <= margin).all(), f"{arch}: a greedy token is not HF's argmax"


@pytest.mark.cuda
def test_cuda_kvcache_fills_our_share_of_the_gpu_and_no_more(tiny_models):
    """Weights, warm-up peak and cache together stay within gpu_memory_utilization of the GPU."""
    engine = LLMEngine(tiny_models["llama"], device="cuda", gpu_memory_utilization=0.3, enforce_eager=True)
    runner, total = engine.model_runner, torch.cuda.mem_get_info()[1]
    assert runner.graph_runner is None and runner.num_kvcache_blocks > 0
    assert torch.cuda.memory_allocated() <= 0.3 * total
    with pytest.raises(ValueError, match="no memory is left for the KV cache"):
        LLMEngine(tiny_models["llama"], device="cuda", gpu_memory_utilization=1e-6, enforce_eager=True)


def test_two_engines_capturing_cpu_graphs_on_two_threads_each_generate_what_eager_does(tiny_models):
    """Graph capture is per thread: an engine capturing on one thread must not record the kernel
    calls that another engine makes meanwhile on another (it would replay them into memory it does
    not own), nor miss its own."""
    import threading
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 1000, (n,), generator=gen).tolist() for n in (3, 17, 40, 5, 9, 12, 2, 30)]
    # Staggered lengths: the batch shrinks through every bucket, so captures keep happening.
    params = [SamplingParams(temperature=0, max_tokens=8 + 6 * i, ignore_eos=True) for i in range(len(prompts))]
    archs = ("llama", "qwen2")
    eager = {arch: [o["token_ids"] for o in LLM(tiny_models[arch], max_model_len=128, enforce_eager=True)
                    .generate(prompts, params, use_tqdm=False)] for arch in archs}
    for _ in range(3):  # each round captures afresh, in new engines
        engines = {arch: LLM(tiny_models[arch], max_model_len=128) for arch in archs}
        start, outputs = threading.Barrier(len(archs)), {}

        def generate(arch: str) -> None:
            start.wait()
            outputs[arch] = [o["token_ids"] for o in engines[arch].generate(prompts, params, use_tqdm=False)]
        threads = [threading.Thread(target=generate, args=(arch,)) for arch in archs]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert outputs == eager
        for engine in engines.values():  # each graph holds its own step's kernel calls, no more, no fewer
            graphs = engine.model_runner.graph_runner.graphs.values()
            counts = {sum(isinstance(call, KernelCall) for call in graph.calls) for graph in graphs}
            assert len(counts) == 1, counts


@pytest.mark.parametrize("arch,kwargs", [("llama", {}), ("llama", {"quantization": "int4"}),
                                         ("qwen2", {"dtype": "bfloat16"})])
def test_cpu_graphs_of_verify_steps_give_the_same_tokens_as_eager_verification(tiny_models, arch, kwargs):
    """Speculative verify steps with the same number of drafts per sequence are recorded and replayed
    (keyed by batch bucket and tokens per sequence): the tokens are eager verification's."""
    prompts = [list(range(100, 140)), list(range(300, 317))]
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    reference = LLM(tiny_models[arch], max_model_len=128, **kwargs).generate(prompts, greedy, use_tqdm=False)
    outputs = {}
    for eager in (False, True):
        llm = LLM(tiny_models[arch], max_model_len=128, enforce_eager=eager, **kwargs,
                  speculative_config={"method": "ngram", "num_speculative_tokens": 3})
        llm.proposer = OracleProposer(prompts, [r["token_ids"] for r in reference])
        outputs[eager] = [o["token_ids"] for o in llm.generate(prompts, greedy, use_tqdm=False)]
        if not eager:
            assert any(q > 1 for _, q in llm.model_runner.graph_runner.graphs)
    assert outputs[False] == outputs[True]
