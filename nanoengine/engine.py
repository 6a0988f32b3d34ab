"""The engine: the public face of nanoengine and the loop that drives everything else.

``LLMEngine`` takes requests (``add_request``), advances all of them by one step at a time
(``step``: schedule -> run the model -> postprocess), and lets a caller drop a request
(``abort_request``). ``LLM.generate`` is the offline batch API built on those three calls.

A step that raises or is interrupted (an exception in the model, Ctrl-C in a notebook) ends the
sequences it was running, frees their blocks and re-raises; every other request, and the prefix
cache, are as if the step had never started (a block the failed step registered but never wrote
loses its hash when freed: see block_manager.py). Ctrl-C is held back while the bookkeeping
itself runs (``interrupts_deferred``), so it can never land between two related updates; the
model's forward stays interruptible.
"""

import signal
import threading
import time
from contextlib import contextmanager

from tqdm.auto import tqdm

from nanoengine.block_manager import BlockManager
from nanoengine.config import Config
from nanoengine.loader import (checkpoint_directory, load_eos_token_ids, load_hf_config, load_tokenizer,
                               resolve_model_path)
from nanoengine.model_runner import ModelRunner
from nanoengine.sampling_params import SamplingParams
from nanoengine.scheduler import Scheduler
from nanoengine.sequence import Sequence
from nanoengine.worker import start_workers


@contextmanager
def interrupts_deferred():
    """Hold a Ctrl-C (SIGINT) that arrives inside the block until the block has finished.

    Bookkeeping updates several structures in turn (queues, block tables, reference counts); a
    KeyboardInterrupt between two of them would leave them inconsistent. Only the main thread
    receives signals, and only a Python-level handler can be swapped, so elsewhere this is a no-op.
    """
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or not callable(previous):
        yield
        return
    received = []
    signal.signal(signal.SIGINT, lambda signum, frame: received.append(frame))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if received:
            previous(signal.SIGINT, received[0])


class LLMEngine:
    def __init__(self, model: str | None = None, **kwargs):
        self.config = config = Config.from_kwargs(model, kwargs)
        path = checkpoint_directory(resolve_model_path(model))
        hf_config = load_hf_config(path)
        self.tokenizer = load_tokenizer(path)
        self.vocab_size = hf_config.vocab_size
        config.resolve_limits(hf_config.max_position_embeddings)
        # Tensor parallelism: the other ranks start first, and load their shards as this one loads its own.
        self.workers = start_workers(config, hf_config, path) if config.tensor_parallel_size > 1 else None
        try:
            self.model_runner = ModelRunner(config, hf_config, path, self.workers and self.workers.group)
        except BaseException:
            if self.workers is not None:
                self.workers.shutdown()
            raise
        config.fit_to_kvcache(self.model_runner.num_kvcache_blocks, self.model_runner.block_size)
        eos_token_ids = load_eos_token_ids(path, hf_config, self.tokenizer)
        self.block_manager = BlockManager(self.model_runner.num_kvcache_blocks, self.model_runner.block_size,
                                          config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.max_model_len, eos_token_ids, config.enable_chunked_prefill)
        self.requests: dict[int, Sequence] = {}
        # Cumulative; "<phase>_tokens" counts the tokens the model computed in that phase.
        self.counters = dict.fromkeys(["prompt_tokens", "generated_tokens", "prefill_steps", "prefill_tokens",
                                       "prefill_seconds", "decode_steps", "decode_tokens", "decode_seconds"], 0)

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """A prompt's token ids, or a ``ValueError`` if the engine could never serve it."""
        if isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            token_ids = list(prompt)
        else:
            raise ValueError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        # The tokenizer's ids too: one larger than the embedding would otherwise fail the whole step.
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the model's vocabulary [0, {self.vocab_size})")
        if not token_ids:
            raise ValueError("prompt is empty")
        if len(token_ids) > self.config.max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens, more than max_model_len="
                             f"{self.config.max_model_len}")
        return token_ids

    def add_request(self, prompt: str | list[int], sampling_params: SamplingParams) -> int:
        """Queue a request; returns its id. The prompt is checked before anything is queued."""
        if not isinstance(sampling_params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}")
        seq = Sequence(self.tokenize(prompt), sampling_params, self.model_runner.block_size)
        self.scheduler.add(seq)
        self.requests[seq.seq_id] = seq
        self.counters["prompt_tokens"] += seq.num_prompt_tokens
        return seq.seq_id

    def abort_request(self, request_id: int) -> None:
        """Drop a request now; its KV blocks return to the pool at once."""
        seq = self.requests.pop(request_id, None)
        if seq is not None and not seq.is_finished:
            self.scheduler.finish(seq, "abort")

    def step(self) -> list[Sequence]:
        """Advance by one model step; returns the sequences that got a token (none when idle, or
        when the step only computed chunks of prompts).

        If the step fails, its sequences are aborted (finish_reason "abort") before the error
        propagates: they may have been half computed, and a caller cannot tell which.
        """
        if self.scheduler.is_finished():
            return []
        with interrupts_deferred():
            seqs = self.scheduler.schedule()
        # A step that computes any prompt token is a prefill step (with chunked prefill, decodes too).
        phase = "decode" if all(seq.is_decode for seq in seqs) else "prefill"
        num_tokens = sum(seq.num_scheduled_tokens for seq in seqs)
        start = time.perf_counter()
        try:
            token_ids = self.model_runner.run(seqs)
            with interrupts_deferred():
                self.scheduler.postprocess(seqs, token_ids)
        except BaseException:
            with interrupts_deferred():
                for seq in seqs:
                    self.abort_request(seq.seq_id)
            raise
        self.counters[f"{phase}_steps"] += 1
        self.counters[f"{phase}_tokens"] += num_tokens
        self.counters[f"{phase}_seconds"] += time.perf_counter() - start
        self.counters["generated_tokens"] += sum(t is not None for t in token_ids)
        for seq in seqs:
            if seq.is_finished:
                self.requests.pop(seq.seq_id, None)
        return [seq for seq, t in zip(seqs, token_ids) if t is not None]

    def has_unfinished_requests(self) -> bool:
        return not self.scheduler.is_finished()

    def stats(self) -> dict:
        return {
            "num_requests_running": len(self.scheduler.running),
            "num_requests_waiting": len(self.scheduler.waiting),
            "num_kvcache_blocks": len(self.block_manager.blocks),
            "kvcache_blocks_in_use": self.block_manager.num_used_blocks,
            "num_preemptions": self.scheduler.num_preemptions,
            "prefix_cache_hit_tokens": self.scheduler.prefix_cache_hit_tokens,
            **self.counters,
        }


class LLM(LLMEngine):
    def generate(self, prompts: list[str] | list[list[int]], sampling_params: SamplingParams | list[SamplingParams],
                 use_tqdm: bool = True) -> list[dict]:
        """Complete every prompt; results come back in the order of the prompts."""
        if not isinstance(prompts, list) or not prompts:
            raise ValueError("prompts must be a non-empty list of strings or of token-id lists")
        if not isinstance(sampling_params, list):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} sampling_params for {len(prompts)} prompts")
        for params in sampling_params:
            if not isinstance(params, SamplingParams):
                raise ValueError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        token_ids = [self.tokenize(p) for p in prompts]  # every prompt checked before any is queued
        seq_ids = [self.add_request(t, p) for t, p in zip(token_ids, sampling_params)]
        seqs = [self.requests[i] for i in seq_ids]
        bar = tqdm(total=len(prompts), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        try:
            while any(not seq.is_finished for seq in seqs):
                stepped = self.step()
                c = self.counters
                bar.set_postfix_str(f"prefill {c['prefill_tokens'] / max(c['prefill_seconds'], 1e-9):.0f} tok/s, "
                                    f"decode {c['decode_tokens'] / max(c['decode_seconds'], 1e-9):.0f} tok/s",
                                    refresh=False)
                bar.update(sum(s.is_finished for s in stepped))
        finally:
            bar.close()
            with interrupts_deferred():
                for seq_id in seq_ids:  # an interrupted generate leaves nothing queued behind
                    self.abort_request(seq_id)
        return [{"text": self.tokenizer.decode(seq.completion_token_ids, skip_special_tokens=True),
                 "token_ids": seq.completion_token_ids, "finish_reason": seq.finish_reason} for seq in seqs]
