"""Offline throughput benchmark in the style of nano-vllm's bench.py.

Random token-id prompts from a seeded generator, input and output lengths uniform in their
ranges, EOS ignored, every request submitted at once. Throughput is output tokens over the wall
time of ``generate`` (model loading excluded). ``--compare-hf`` runs HF transformers' ``generate``
on the same requests, dtype and device, for the ratio (on CUDA after the engine's cache and graphs are
freed). ``--preset nano-vllm`` is nano-vllm's bench.py exactly (256 sequences, input and output
lengths uniform in 100..1024, prompt ids uniform in 0..10000, max_model_len 4096, a step budget of
16384 tokens; nano-vllm ran it with Qwen3-0.6B), the command to compare against its numbers on a GPU.
``--load-format dummy`` runs a model directory that holds only its config.json (tests/data keeps
Qwen3-0.6B's), with random weights: throughput does not depend on their values.
Every run also prints its roofline (nanoengine/roofline.py): the bytes its decode steps had to
read (the weights once a step, each sequence's K/V up to its context length) over their time,
against the memory bandwidth a copy loop measures on the same device (or ``--peak-bandwidth-gbs``),
and its prefill steps' FLOPs over their time against a matmul's rate in the run's dtype (or
``--peak-tflops``); with tensor parallelism, for rank 0's shard against one device's peaks.
``--timeline PATH.png`` plots the run step by step (needs matplotlib: ``pip install -e ".[plot]"``).
``--penalties`` gives every request a repetition penalty of 1.1 and presence and frequency penalties
of 0.5, to measure what the logits processors cost. ``--workload grounded`` asks the model (through
its chat template) to repeat passages given in the prompt, greedy: the workload speculative decoding
(``--speculative-config``) is for. ``--structured-output json`` constrains every request to one JSON
schema (an order record: nested objects, an array of them, an enum, a pattern, required fields),
each prompt a chat request asking for such a record; the same requests then run unconstrained, each
for as many tokens as its constrained run made, so that the two throughputs differ by the grammar's
cost alone, and both are reported (the prefix cache is off, so that the second run does not find
the first one's prompts cached).
"""

import argparse
import gc
import json
import os
import random
import resource
import time
from dataclasses import replace

import torch

from nanoengine import LLM, SamplingParams, StructuredOutputsParams
from nanoengine.roofline import StepCosts, measure_bandwidth, measure_peak_flops, roofline
from nanoengine.trace import StepObserver

ORDER_SCHEMA = {  # --structured-output json's: nested objects, an array of them, an enum, a pattern, required fields
    "type": "object", "additionalProperties": False, "required": ["id", "customer", "items", "status"], "properties": {
        "id": {"type": "integer", "minimum": 1},
        "customer": {"type": "object", "additionalProperties": False, "required": ["name", "email"], "properties": {
            "name": {"type": "string", "maxLength": 40}, "city": {"type": "string", "maxLength": 30},
            "email": {"type": "string", "pattern": "^[a-z0-9.]{1,20}@[a-z0-9]{1,20}\\.[a-z]{2,4}$"}}},
        "items": {"type": "array", "minItems": 1, "maxItems": 5, "items": {
            "type": "object", "additionalProperties": False, "required": ["product", "quantity", "unit_price"],
            "properties": {"product": {"type": "string", "maxLength": 30},
                           "quantity": {"type": "integer", "minimum": 1, "maximum": 100},
                           "unit_price": {"type": "number", "minimum": 0}}}},
        "status": {"enum": ["pending", "paid", "shipped", "delivered", "cancelled"]},
        "note": {"type": "string", "maxLength": 80}}}
JSON_PROMPT_TOKENS = 256  # room for --structured-output's prompts (about 100 tokens), whatever --max-input-len says


# The input-grounded workload: the model is asked to repeat or edit a passage given in its prompt,
# the kind of output speculative decoding by prompt lookup is for. Passages written for this bench.
PASSAGES = [
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He wound the clockwork, "
    "trimmed the wick and polished the great lens until it shone. Ships passing the headland counted "
    "the flashes, three short and one long, and knew exactly where they were. In forty years the light "
    "had never once failed, not in the storm of the long winter, not on the night the harbour froze.",
    "To make bread, mix flour, water, salt and a little yeast in a large bowl. Knead the dough for ten "
    "minutes, until it is smooth and springs back when pressed. Leave it covered in a warm place for an "
    "hour, then shape it into a loaf and let it rise again. Bake it in a hot oven for forty minutes, "
    "until the crust is brown and the loaf sounds hollow when tapped underneath.",
    "The library opens at nine in the morning and closes at six in the evening, except on Sundays, when "
    "it is closed all day. Members may borrow up to eight books at a time for three weeks. Books can be "
    "renewed twice, online or at the front desk, unless another member has reserved them. Late returns "
    "cost ten cents a day, and lost books must be paid for at the price of a new copy.",
    "Our small village sits at the foot of a green hill, beside a slow river. In spring the orchards "
    "bloom white and pink, and in summer children swim below the old stone bridge. Every autumn the "
    "whole village gathers in the square for the harvest fair, with music, apple pies and a contest for "
    "the largest pumpkin. In winter the hill is covered in snow and the river turns to ice.",
]
TASKS = ["Repeat the following text exactly, word for word:\n\n{}",
         "Copy out this passage, keeping every sentence as it is:\n\n{}"]


def grounded_prompts(tokenizer, num_seqs: int) -> list[list[int]]:
    """Chat prompts asking to repeat two passages (about 170 tokens), cycling through passages and wordings."""
    def text(i: int) -> str:
        return PASSAGES[i % len(PASSAGES)] + "\n\n" + PASSAGES[(i + 1) % len(PASSAGES)]
    return [tokenizer.apply_chat_template([{"role": "user", "content": TASKS[i // len(PASSAGES) % len(TASKS)].format(
        text(i))}], tokenize=True, add_generation_prompt=True, return_dict=False) for i in range(num_seqs)]


def make_requests(args, vocab_size: int):
    """Prompts, then output lengths, drawn in nano-vllm's order from one seeded generator."""
    rng = random.Random(args.seed)
    top = 10000 if getattr(args, "preset", None) == "nano-vllm" else vocab_size - 1  # nano-vllm: randint(0, 10000)
    prompts = [[rng.randint(0, top) for _ in range(rng.randint(args.min_input_len, args.max_input_len))]
               for _ in range(args.num_seqs)]
    output_lens = [rng.randint(args.min_output_len, args.max_output_len) for _ in range(args.num_seqs)]
    return prompts, output_lens


def json_requests(args, llm: LLM):
    """``--structured-output json``'s prompts: chat requests for an order record as JSON, their
    details drawn from a seeded generator; output lengths as ``make_requests`` draws them."""
    rng = random.Random(args.seed)
    people = ["Ada Park", "Bo Chen", "Carla Diaz", "Dev Patel", "Eun Kim", "Femi Ade"]
    cities = ["Lyon", "Osaka", "Lima", "Accra", "Quebec"]
    products = ["desk lamp", "green tea", "hiking boots", "notebook", "USB cable", "rain jacket", "coffee beans"]

    def prompt(i: int) -> list[int]:
        items = ", ".join(f"{rng.randint(1, 5)} x {rng.choice(products)}" for _ in range(rng.randint(1, 4)))
        return llm.chat_prompt([{"role": "user", "content": (
            f"Order {1000 + i} from {rng.choice(people)} in {rng.choice(cities)}: {items}. Write it as a JSON "
            "object with id, customer (name, email, city), items (product, quantity, unit_price), status and "
            "a short note.")}])
    prompts = [prompt(i) for i in range(args.num_seqs)]
    return prompts, [rng.randint(args.min_output_len, args.max_output_len) for _ in range(args.num_seqs)]


def parses(text: str) -> bool:
    """Whether ``text`` is JSON (a closed constrained output always should be)."""
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def hf_throughputs(config, prompts, output_lens, dtype: torch.dtype, device: torch.device) -> dict[int, float]:
    """HF generate's throughput in static, left-padded batches of 8, 32 and 64.

    Each batch size runs the whole workload, and the caller reports the fastest. A short probe
    to choose one was tried first. On this noisy machine it once chose batch 8, at 93 tok/s
    against 155 at batch 32, and that flattered the ratio. With ``load_format="dummy"`` HF's model
    is built from the config with its own random weights, as the engine's are.
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    from nanoengine.loader import resolve_model_path
    path = resolve_model_path(config.model)
    if config.load_format == "dummy":
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype)
    else:
        kwargs = {"gguf_file": os.path.basename(path)} if path.endswith(".gguf") else {}
        model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path) if kwargs else path, dtype=dtype, **kwargs)
    model.to(device).eval()
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0

    def run(batch_prompts, batch_lens) -> float:
        width = max(map(len, batch_prompts))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch_prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch_prompts], device=device)
        new = max(batch_lens)  # a static batch runs until its longest request is done
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=pad)
        if device.type == "cuda":
            torch.cuda.synchronize()  # stop the clock when the GPU is done, not when the launches are
        return time.perf_counter() - start

    def seconds(bs: int) -> float:
        return sum(run(prompts[i:i + bs], output_lens[i:i + bs]) for i in range(0, len(prompts), bs))

    return {bs: sum(output_lens) / seconds(bs) for bs in (8, 32, 64)}


def plot_timeline(records: list[dict], path: str, title: str) -> None:
    """Per step, one panel each: prompt tokens computed (a log scale, so that the first prefill,
    hundreds of tokens, does not flatten the later ones), sequences decoding, KV blocks in use against
    the cache's size, and the steps that preempted or read prompts from the prefix cache. Legends sit
    outside the panels, never over the data."""
    import matplotlib
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    fig, (prompt, decode, blocks, events) = plt.subplots(4, 1, sharex=True, figsize=(11, 8),
                                                         height_ratios=[2, 1.5, 2, 1.2])
    prompt.bar(steps, [r["prefill_tokens"] for r in records], width=1.0, color="tab:orange",
               label="prompt tokens computed")
    prompt.set_yscale("log")
    prompt.set_ylim(bottom=1)
    prompt.set_ylabel("prompt tokens")
    prompt.set_title(title)
    decode.step(steps, [r["decode_seqs"] for r in records], where="mid", color="tab:blue",
                label="sequences decoding")
    decode.set_ylim(bottom=0)
    decode.set_ylabel("sequences")
    blocks.fill_between(steps, [r["kv_blocks_used"] for r in records], step="mid", color="tab:green", alpha=0.5,
                        label="KV blocks in use")
    blocks.axhline(records[0]["num_kv_blocks"], color="black", linestyle="--", label="KV blocks in the cache")
    blocks.set_ylim(bottom=0)
    blocks.set_ylabel("KV blocks")
    events.bar(steps, [r["prefix_hit_tokens"] for r in records], width=1.0, color="tab:purple",
               label="prompt tokens from\nthe prefix cache")
    events.set_ylabel("cached tokens")
    preempted = [(s, r["preemptions"]) for s, r in zip(steps, records) if r["preemptions"]]
    for s, _ in preempted:
        events.axvline(s, color="tab:red", alpha=0.6)
    events.plot([], [], color="tab:red", label=f"preemption\n({sum(n for _, n in preempted)} in all)")
    events.set_xlabel("engine step")
    for ax in (prompt, decode, blocks, events):
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def json_path(text: str) -> str:
    """``--json``'s PATH, refused at once if its directory does not exist, not after the run."""
    if not os.path.isdir(os.path.dirname(os.path.abspath(text))):
        raise argparse.ArgumentTypeError(f"{text}: its directory does not exist")
    return text


def add_workload_options(parser: argparse.ArgumentParser) -> None:
    """The workload's options; bench_serving.py takes them too, to send the same requests over HTTP."""
    parser.add_argument("--model", default=None, help="HF model directory or .gguf file (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--num-seqs", type=int, default=64)
    parser.add_argument("--min-input-len", type=int, default=32)
    parser.add_argument("--max-input-len", type=int, default=256)
    parser.add_argument("--min-output-len", type=int, default=32)
    parser.add_argument("--max-output-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--preset", choices=["nano-vllm"], help="nano-vllm's workload: 256 seqs, in/out 100..1024")
    parser.add_argument("--workload", default="random", choices=["random", "grounded"],
                        help="random: token-id prompts, EOS ignored (nano-vllm's); grounded: chat prompts asking "
                             "to repeat a passage, greedy, up to --max-output-len tokens (for speculative decoding)")


def resolve_workload(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Apply ``--preset`` and check the length ranges; ``args.max_model_len`` is the engine's."""
    args.max_model_len = args.max_input_len + args.max_output_len
    if args.preset == "nano-vllm":
        args.num_seqs, args.min_input_len, args.max_input_len = 256, 100, 1024
        args.min_output_len, args.max_output_len = 100, 1024
        args.max_model_len = 4096
        if getattr(args, "max_num_batched_tokens", None) is None:
            args.max_num_batched_tokens = 16384  # nano-vllm's default budget
    if args.num_seqs < 1:
        parser.error("--num-seqs must be >= 1")
    for lo, hi in (("min_input_len", "max_input_len"), ("min_output_len", "max_output_len")):
        if not 1 <= getattr(args, lo) <= getattr(args, hi):
            parser.error(f"--{lo.replace('_', '-')} must be >= 1 and <= --{hi.replace('_', '-')}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_options(parser)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--enable-chunked-prefill", action="store_true",
                        help="mix decodes and prompt chunks in one step (vLLM V1's scheduling)")
    parser.add_argument("--max-num-batched-tokens", type=int, help="the step's token budget (default: the engine's)")
    parser.add_argument("--quantization", choices=["int8", "int4"], help="weight-only quantization (default: none)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="ranks to split the model over")
    parser.add_argument("--json", metavar="PATH", type=json_path, help="also write the results as JSON to PATH")
    parser.add_argument("--compare-hf", action="store_true", help="also run HF transformers on the same requests")
    parser.add_argument("--num-kvcache-blocks", type=int, help="a fixed KV cache size (default: from the memory budget)")
    parser.add_argument("--timeline", metavar="PATH.png", help="plot batch, KV blocks and preemptions per step")
    parser.add_argument("--attention-backend", default="auto", choices=["auto", "flash-attn", "triton", "torch"],
                        help="auto: flash-attn on CUDA where installed, else Triton; the C++ kernels on CPU")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"],
                        help="K/V in the model's dtype (auto) or in 8 bits (fp8 = fp8_e4m3, fp8_e5m2)")
    parser.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                        help="dummy: random weights, for a model directory with only its config.json")
    parser.add_argument("--penalties", action="store_true",
                        help="every request with repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5")
    parser.add_argument("--speculative-config", type=json.loads, metavar="JSON",
                        help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'')
    parser.add_argument("--peak-bandwidth-gbs", type=float, metavar="GB/S",
                        help="the memory bandwidth the roofline compares decode with (default: measured by a copy)")
    parser.add_argument("--peak-tflops", type=float, metavar="TFLOP/S",
                        help="the compute peak the roofline compares prefill with (default: measured by a matmul)")
    parser.add_argument("--structured-output", choices=["json"],
                        help="every request constrained to a JSON schema, its prompt asking for JSON; reported "
                             "beside the same requests unconstrained")
    args = parser.parse_args()
    resolve_workload(parser, args)
    if args.workload == "grounded" and args.compare_hf:
        parser.error("--compare-hf runs the random workload only (HF's generate would stop at other places)")
    if args.structured_output:
        if args.compare_hf or args.workload == "grounded":
            parser.error("--structured-output brings its own prompts and runs them without a grammar too: "
                         "not with --compare-hf or --workload grounded")
        args.max_model_len = JSON_PROMPT_TOKENS + args.max_output_len
    for name in ("peak_bandwidth_gbs", "peak_tflops"):
        if getattr(args, name) is not None and not getattr(args, name) > 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0")
    if args.timeline:
        try:
            import matplotlib  # noqa: F401  (checked before the run, not after it)
        except ImportError:
            parser.error('--timeline needs matplotlib: pip install -e ".[plot]"')

    # Token-id prompts only: no tokenizer needed, so a directory with just a config.json runs too
    # (the grounded workload's chat prompts and --structured-output's grammar need the tokenizer).
    grounded = args.workload == "grounded"
    try:  # an option the engine refuses is the command line's error, as serve reports it
        llm = LLM(args.model, dtype=args.dtype, device=args.device, enforce_eager=args.enforce_eager,
                  quantization=args.quantization, max_model_len=None if grounded else args.max_model_len,
                  skip_tokenizer_init=not (grounded or args.structured_output),
                  speculative_config=args.speculative_config, enable_prefix_caching=not args.structured_output,
                  attention_backend=args.attention_backend, load_format=args.load_format,
                  kv_cache_dtype=args.kv_cache_dtype, enable_chunked_prefill=args.enable_chunked_prefill,
                  max_num_batched_tokens=args.max_num_batched_tokens,
                  tensor_parallel_size=args.tensor_parallel_size, num_kvcache_blocks=args.num_kvcache_blocks)
    except ValueError as e:
        parser.error(str(e))
    prompts, output_lens = json_requests(args, llm) if args.structured_output else make_requests(args, llm.vocab_size)
    options = dict(repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5) if args.penalties else {}
    if args.structured_output:
        options["structured_outputs"] = StructuredOutputsParams(json=ORDER_SCHEMA)
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n, **options) for n in output_lens]
    if grounded:
        prompts = grounded_prompts(llm.tokenizer, args.num_seqs)
        params = [SamplingParams(temperature=0.0, max_tokens=args.max_output_len, **options)] * args.num_seqs
    # Warm-up, twice on a prompt no request starts with: the second reads the first's blocks back from
    # the prefix cache, so both kinds of prefill compile their Triton kernels before timing (about
    # half a second each on a fresh GPU machine). A constrained one also reads the vocabulary into
    # the grammar library (about a second, once).
    for _ in range(2):
        llm.generate([prompts[0][1:34]], replace(params[0], max_tokens=4), use_tqdm=False)
    if grounded and args.speculative_config:
        # Verify steps record a CPU graph per number of drafts at first sight: see them all before timing,
        # on a prompt that is not one of the run's.
        llm.generate(grounded_prompts(llm.tokenizer, args.num_seqs + 1)[-1:], params[:1], use_tqdm=False)
    observer = StepObserver(llm)  # counts and seconds per step, after the warm-up
    before = llm.stats()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    s = {k: v - before[k] for k, v in llm.stats().items() if k in before and k.endswith(("tokens", "seconds", "steps",
                                                                                          "seqs", "preemptions", "drafts"))}
    records = list(observer.records)  # this run's steps only (--structured-output runs again below)
    total = s["generated_tokens"]  # the output lengths, or fewer where EOS or a grammar ended a request
    results = {
        "dtype": str(llm.model_runner.dtype).removeprefix("torch."),
        "quantization": args.quantization,
        "tensor_parallel_size": args.tensor_parallel_size,
        "threads": torch.get_num_threads(),
        # 0 where a run had no such step (a one-token output never decodes)
        "prefill_tok_per_s": s["prefill_tokens"] / s["prefill_seconds"] if s["prefill_seconds"] else 0.0,
        "decode_tok_per_s": s["decode_tokens"] / s["decode_seconds"] if s["decode_seconds"] else 0.0,
        "mean_decode_batch": s["decode_seqs"] / max(s["decode_steps"], 1),
        "num_preemptions": s["num_preemptions"],
        "prefix_cache_hit_rate": s["prefix_cache_hit_tokens"] / max(s["prompt_tokens"], 1),
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "total_tokens": total, "seconds": elapsed, "throughput_tok_per_s": total / elapsed,
    }
    runner = llm.model_runner
    peak_bandwidth = args.peak_bandwidth_gbs * 1e9 if args.peak_bandwidth_gbs else measure_bandwidth(runner.device)
    peak_flops = args.peak_tflops * 1e12 if args.peak_tflops else measure_peak_flops(runner.device, runner.dtype)
    results.update(roofline(records, StepCosts.of(runner), peak_bandwidth, peak_flops))
    if args.speculative_config:
        results.update({k: s[k] for k in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                                          "spec_decode_num_accepted_tokens")})
        # vLLM's mean acceptance length: tokens per verification, the target's own one included.
        results["mean_accepted_length"] = 1 + s["spec_decode_num_accepted_tokens"] / max(s["spec_decode_num_drafts"], 1)
    if args.num_seqs == 1:
        # One request: its latency, to set beside llama.cpp's llama-bench (tg128 is 1e3 / TPOT).
        # TTFT is the prefill step; TPOT the decode steps' time per token they gave (all but the
        # first; a step gives more than one with speculative decoding), None for a one-token output.
        results.update(ttft_ms=1e3 * s["prefill_seconds"] / s["prefill_steps"],
                       tpot_ms=1e3 * s["decode_seconds"] / (total - 1) if total > 1 else None)
    print(f"dtype: {results['dtype']}, quantization: {args.quantization}, threads: {results['threads']}, "
          f"device: {llm.model_runner.device}, tensor parallel size: {args.tensor_parallel_size}")
    print(f"Prefill: {results['prefill_tok_per_s']:.2f}tok/s, Decode: {results['decode_tok_per_s']:.2f}tok/s, "
          f"mean decode batch: {results['mean_decode_batch']:.1f}")
    print(f"Preemptions: {results['num_preemptions']}, prefix-cache hit rate: {results['prefix_cache_hit_rate']:.1%}, "
          f"peak RSS: {results['peak_rss_gib']:.2f}GiB")
    flops_unit, flops_scale = ("TFLOP/s", 1e12) if peak_flops >= 1e12 else ("GFLOP/s", 1e9)
    print(f"Roofline: decode {results['decode_bytes_per_s'] / 1e9:.2f}GB/s, {results['decode_bandwidth_fraction']:.1%} "
          f"of {peak_bandwidth / 1e9:.1f}GB/s ({'given' if args.peak_bandwidth_gbs else 'copy loop'}), reading "
          f"weights {results['decode_weight_bytes'] / 1e9:.2f}GB + K/V {results['decode_kv_bytes'] / 1e9:.2f}GB in "
          f"{results['decode_step_seconds']:.2f}s; prefill "
          f"{results['prefill_flops_per_s'] / flops_scale:.2f}{flops_unit}, {results['prefill_compute_fraction']:.1%} "
          f"of {peak_flops / flops_scale:.2f}{flops_unit} "
          f"({'given' if args.peak_tflops else results['dtype'] + ' matmul'})"
          + (f"; rank 0's shard of {args.tensor_parallel_size}" if args.tensor_parallel_size > 1 else ""))
    if args.speculative_config:
        print(f"Speculative decoding: {results['spec_decode_num_accepted_tokens']} of "
              f"{results['spec_decode_num_draft_tokens']} draft tokens accepted, mean accepted length "
              f"{results['mean_accepted_length']:.2f}")
    if args.num_seqs == 1:
        tpot = results["tpot_ms"]
        print(f"Single request: TTFT: {results['ttft_ms']:.1f}ms, "
              + (f"TPOT: {tpot:.2f}ms ({1e3 / tpot:.1f}tok/s)" if tpot else "no TPOT (one output token)"))
    if args.timeline:
        plot_timeline(records, args.timeline, f"bench.py: {args.num_seqs} requests, {total} output tokens, "
                      f"{'chunked prefill' if args.enable_chunked_prefill else 'prefill-first'}")
    if args.structured_output:
        # The same requests unconstrained, each as long as its constrained run: the grammar's cost alone.
        free = [replace(p, structured_outputs=None, max_tokens=len(o["token_ids"])) for p, o in zip(params, outputs)]
        start = time.perf_counter()
        llm.generate(prompts, free, use_tqdm=False)
        free_throughput = sum(p.max_tokens for p in free) / (time.perf_counter() - start)
        closed = [o for o in outputs if o["finish_reason"] == "stop"]
        results.update(unconstrained_throughput_tok_per_s=free_throughput, num_json_closed=len(closed),
                       num_json_parsed=sum(parses(o["text"]) for o in closed),
                       structured_vs_unconstrained=results["throughput_tok_per_s"] / free_throughput)
        print(f"Structured output ({args.structured_output}): {total / elapsed:.2f}tok/s, the same requests "
              f"unconstrained: {free_throughput:.2f}tok/s ({results['structured_vs_unconstrained']:.2f}x); "
              f"{len(closed)} of {len(outputs)} closed their JSON, {results['num_json_parsed']} of them parse")
    if args.compare_hf:
        config, dtype, device = llm.config, llm.model_runner.dtype, llm.model_runner.device
        del llm, observer  # on a GPU, HF gets the memory of the engine's KV cache and graphs back
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        by_batch = hf_throughputs(config, prompts, output_lens, dtype, device)
        batch = max(by_batch, key=by_batch.get)
        results.update(hf_throughput_by_batch=by_batch, hf_throughput_tok_per_s=by_batch[batch], hf_batch_size=batch,
                       speedup_vs_hf=results["throughput_tok_per_s"] / by_batch[batch])
        print("HF transformers by batch size: " + ", ".join(f"{bs}: {tps:.2f}tok/s" for bs, tps in by_batch.items()))
        print(f"HF transformers (batch {batch}): {by_batch[batch]:.2f}tok/s; nanoengine is {results['speedup_vs_hf']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    print(f"Total: {total}tok, Time: {elapsed:.2f}s, Throughput: {total / elapsed:.2f}tok/s")


if __name__ == "__main__":
    main()
