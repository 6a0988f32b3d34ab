"""Serving benchmark: bench.py's workload sent over HTTP, streaming, as clients would send it.

It starts ``python -m nanoengine.serve`` (options it does not know itself go to the server, e.g.
``--max-num-seqs 32 --enforce-eager``), or with ``--base-url`` measures a server already running:
another nanoengine, vLLM, or llama.cpp's llama-server. The requests are bench.py's (the same
seed and length options give the same prompts and output lengths), sent to ``/v1/completions``
as token-id prompts with ``ignore_eos``, so every server computes the same tokens whatever its
tokenizer. They arrive as a Poisson process at ``--request-rate`` requests per second (``inf``:
all at once), and every response streams. The latencies follow vLLM's benchmark_serving:

- TTFT (time to first token): from sending a request to its first streamed chunk;
- ITL (inter-token latency): the gap between two consecutive chunks of one response, over every
  gap of every response;
- TPOT (time per output token): per request, (end-to-end latency - TTFT) / (output tokens - 1).

Throughput is over the benchmark's wall time, from the first request sent to the last response
ended. A separate file from bench.py because it measures another thing, a server through its
HTTP API from a client process, where bench.py calls ``LLM.generate`` in-process.
"""

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import IO, Iterator

import aiohttp

from bench import add_workload_options, json_path, make_requests, resolve_workload


@dataclass
class RequestResult:
    prompt_len: int
    output_len: int = 0  # the server's usage count, or max_tokens if it sends none (ignore_eos makes them equal)
    ttft: float = 0.0
    latency: float = 0.0  # end to end
    itl: list[float] = field(default_factory=list)
    error: str | None = None


async def send(session: aiohttp.ClientSession, model: str, prompt: list[int], max_tokens: int) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.6, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    result, chunk_times = RequestResult(len(prompt), output_len=max_tokens), []
    start = time.perf_counter()
    try:
        async with session.post("/v1/completions", json=body) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:300]}"
                return result
            async for line in response.content:  # server-sent events: one "data: {json}" line per chunk
                line = line.strip()
                if not line.startswith(b"data:") or line.endswith(b"[DONE]"):
                    continue
                chunk = json.loads(line.removeprefix(b"data:"))
                if "error" in chunk:
                    result.error = json.dumps(chunk["error"])[:300]
                    return result
                if chunk.get("choices"):
                    chunk_times.append(time.perf_counter())
                if chunk.get("usage"):
                    result.output_len = chunk["usage"]["completion_tokens"]
    except (aiohttp.ClientError, ValueError) as e:  # ValueError: a line past aiohttp's limit, or bad JSON
        result.error = f"{type(e).__name__}: {e}"
        return result
    if not chunk_times:
        result.error = "the response streamed no chunk"
        return result
    result.ttft, result.latency = chunk_times[0] - start, time.perf_counter() - start
    result.itl = [b - a for a, b in zip(chunk_times, chunk_times[1:])]
    return result


async def run(base_url: str, prompts: list[list[int]], output_lens: list[int], request_rate: float,
              seed: int) -> tuple[list[RequestResult], float]:
    """Send every request, Poisson-spaced; returns their results and the benchmark's wall time.

    The client is aiohttp, as in vLLM's benchmark: on a 2-core machine the client's CPU comes out
    of the server's, and httpx spent 1.0-1.4 s of it on this workload's 5,400 chunks against
    aiohttp's 0.27-0.30 s (a stand-in server streaming them, no model).
    """
    arrivals = random.Random(seed)
    # No connection limit: with a pool, requests past its size would queue in the client, unmeasured.
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(base_url, connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        async with session.get("/v1/models") as response:
            models = (await response.json())["data"]
        model = models[0]["id"] if models else ""
        warm_up = await send(session, model, prompts[0][:16], 4)  # as bench.py does, out of the clock
        if warm_up.error:
            raise SystemExit(f"the warm-up request failed: {warm_up.error}")
        start, tasks = time.perf_counter(), []
        for prompt, max_tokens in zip(prompts, output_lens):
            tasks.append(asyncio.create_task(send(session, model, prompt, max_tokens)))
            if request_rate != float("inf"):
                await asyncio.sleep(arrivals.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


def percentile(values: list[float], p: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default, which vLLM's benchmark uses)."""
    values = sorted(values)
    rank = (len(values) - 1) * p / 100
    low = int(rank)
    high = min(low + 1, len(values) - 1)
    return values[low] + (values[high] - values[low]) * (rank - low)


def summarize(results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.error is None]
    summary = {"completed": len(ok), "failed": len(results) - len(ok), "duration": duration,
               "total_input_tokens": sum(r.prompt_len for r in ok),
               "total_output_tokens": sum(r.output_len for r in ok),
               "request_throughput": len(ok) / duration,
               "output_throughput": sum(r.output_len for r in ok) / duration}
    samples = {"ttft": [r.ttft for r in ok],
               "tpot": [(r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1],
               "itl": [gap for r in ok for gap in r.itl]}
    for name, values in samples.items():
        values = values or [float("nan")]
        summary[f"mean_{name}_ms"] = 1e3 * sum(values) / len(values)
        for label, p in (("median", 50), ("p90", 90), ("p99", 99)):
            summary[f"{label}_{name}_ms"] = 1e3 * percentile(values, p)
    summary["max_itl_ms"] = 1e3 * max(samples["itl"], default=float("nan"))
    return summary


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def nanoengine_server(server_args: list[str], output: IO | None = None) -> Iterator[str]:
    """Start ``python -m nanoengine.serve`` on a free port; yields its URL once it is healthy.

    The server's output goes to ``output`` (default: this process's). tests/test_serve.py starts
    its server here too.
    """
    port = free_port()
    cmd = [sys.executable, "-m", "nanoengine.serve", "--port", str(port), *server_args]
    # Run from beside this file, so that the nanoengine here is the one served.
    server = subprocess.Popen(cmd, stdout=output, stderr=output, cwd=os.path.dirname(os.path.abspath(__file__)))
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            if server.poll() is not None:
                raise SystemExit(f"the server exited with code {server.returncode}: {' '.join(cmd)}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=1) as response:
                    if response.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)
        yield url
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def vocab_size(model: str | None) -> int:
    from nanoengine.loader import checkpoint_directory, load_hf_config, resolve_model_path
    return load_hf_config(checkpoint_directory(resolve_model_path(model))).vocab_size


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Other options are passed to `python -m nanoengine.serve`.")
    add_workload_options(parser)  # --model also names the vocabulary the prompts are drawn from
    parser.add_argument("--base-url", help="an OpenAI-compatible server to measure instead of starting one")
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="requests per second, Poisson arrivals (default: inf, all at once)")
    parser.add_argument("--json", metavar="PATH", type=json_path, help="also write the results as JSON to PATH")
    args, server_args = parser.parse_known_args()
    resolve_workload(parser, args)
    if args.workload != "random":
        parser.error("--workload: only random's token-id prompts are sent over HTTP (grounded is bench.py's)")
    if not args.request_rate > 0:
        parser.error("--request-rate must be positive (inf: all at once)")
    if args.base_url and server_args:
        parser.error(f"unknown options {server_args}: with --base-url no server is started to pass them to")

    prompts, output_lens = make_requests(args, vocab_size(args.model))
    if args.base_url:
        try:
            results, duration = asyncio.run(run(args.base_url, prompts, output_lens, args.request_rate, args.seed))
        except (aiohttp.ClientError, ValueError) as e:  # no server there, or a URL aiohttp cannot use
            parser.exit(1, f"bench_serving.py: could not benchmark {args.base_url}: {e}\n")
    else:
        # bench.py's max_model_len, which sizes the CPU's KV cache; argparse keeps the last of a
        # repeated option, so a --max-model-len among server_args wins.
        model = ["--model", args.model] if args.model else []
        max_model_len = ["--max-model-len", str(args.max_model_len)]
        with nanoengine_server([*model, *max_model_len, *server_args]) as url:
            results, duration = asyncio.run(run(url, prompts, output_lens, args.request_rate, args.seed))
    s = summarize(results, duration)
    s.update(request_rate=str(args.request_rate), num_prompts=len(prompts), base_url=args.base_url)
    print(f"Requests: {s['completed']} completed, {s['failed']} failed, in {duration:.2f}s "
          f"at request rate {args.request_rate}")
    print(f"Request throughput: {s['request_throughput']:.2f}req/s, "
          f"Output throughput: {s['output_throughput']:.2f}tok/s ({s['total_output_tokens']}tok)")
    for name in ("ttft", "tpot", "itl"):
        print(f"{name.upper()} ms: mean {s[f'mean_{name}_ms']:.1f}, p50 {s[f'median_{name}_ms']:.1f}, "
              f"p90 {s[f'p90_{name}_ms']:.1f}, p99 {s[f'p99_{name}_ms']:.1f}"
              + (f", max {s['max_itl_ms']:.1f}" if name == "itl" else ""))
    for error in sorted({r.error for r in results if r.error})[:5]:
        print(f"error: {error}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(s, f, indent=2)
    if s["failed"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
