"""The engine: the public face of nanoengine and the loop that drives everything else.

``LLMEngine`` takes requests (``add_request``), advances all of them by one step at a time
(``step``: schedule -> run the model -> postprocess, then, with speculative decoding, the drafts
the next step will verify: spec_decode.py), and lets a caller drop a request (``abort_request``).
A request is a sequence group: its first sequence's ``group`` lists the ``n`` samples once they
are forked. ``LLM`` (llm.py) is the offline API built on those three calls. Prompts are checked
and tokenized before anything is queued (input_processor.py).

A step that raises or is interrupted (an exception in the model, Ctrl-C in a notebook) ends the
sequences it was running, frees their blocks and re-raises; every other request, and the prefix
cache, are as if the step had never started (a block the failed step cached but never wrote
loses its hash when freed: see block_manager.py). Ctrl-C is held back while the bookkeeping
itself runs (``interrupts_deferred``), so it can never land between two related updates; the
model's forward stays interruptible.
"""

import logging
import signal
import threading
import time
from contextlib import contextmanager

from nanoengine.block_manager import BlockManager
from nanoengine.config import Config
from nanoengine.input_processor import InputProcessor
from nanoengine.loader import (checkpoint_directory, load_eos_token_ids, load_hf_config, load_tokenizer,
                               resolve_model_path)
from nanoengine.model_runner import ModelRunner
from nanoengine.pooler import PoolingParams
from nanoengine.sampling_params import SamplingParams
from nanoengine.scheduler import Scheduler
from nanoengine.sequence import Sequence
from nanoengine.spec_decode import NgramProposer, Proposer
from nanoengine.spec_draft_model import DraftModelProposer
from nanoengine.structured_output import GrammarCompiler
from nanoengine.worker import start_workers

logger = logging.getLogger(__name__)


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
        hf_config = load_hf_config(path, config.hf_overrides)
        self.tokenizer = None if config.skip_tokenizer_init else load_tokenizer(path)
        self.vocab_size = hf_config.vocab_size
        config.resolve_limits(hf_config.max_position_embeddings)
        config.resolve_pooler(path)
        # Tensor parallelism: the other ranks start first, and load their shards as this one loads its own.
        self.workers = start_workers(config, hf_config, path) if config.tensor_parallel_size > 1 else None
        eos_token_ids = load_eos_token_ids(path, hf_config, self.tokenizer)
        try:
            self.model_runner = ModelRunner(config, hf_config, path, self.workers and self.workers.group, eos_token_ids)
        except BaseException:
            if self.workers is not None:
                self.workers.shutdown()
            raise
        sliding_window = self.model_runner.model.spec.kv_sliding_window  # None unless every layer slides
        config.fit_to_kvcache(self.model_runner.num_kvcache_blocks, self.model_runner.block_size, sliding_window)
        runner = self.model_runner
        logger.info("KV cache: %d tokens (%d blocks of %d) in %s", runner.num_kvcache_blocks * runner.block_size,
                    runner.num_kvcache_blocks, runner.block_size, runner.kv_cache_dtype)
        self.block_manager = BlockManager(self.model_runner.num_kvcache_blocks, self.model_runner.block_size,
                                          config.enable_prefix_caching, sliding_window)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.max_model_len, eos_token_ids, config.enable_chunked_prefill)
        self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size, eos_token_ids)
        self.input_processor = InputProcessor(self.tokenizer, self.vocab_size, config, eos_token_ids, self.grammars,
                                              self.model_runner.pooler)
        spec = config.speculative_config  # the proposer it asks for, if any
        self.proposer: Proposer | None = (None if spec is None else NgramProposer(spec) if spec.method == "ngram"
                                          else DraftModelProposer(spec, config, hf_config, self.model_runner.num_kvcache_blocks))
        self.requests: dict[int, Sequence] = {}  # request id -> its first sequence
        # Cumulative; "<phase>_tokens" counts the tokens the model computed in that phase that were
        # kept (a rejected draft's position is taken back, so it is not), "decode_seqs" the sequences
        # of the decode steps (a mean decode batch is decode_seqs / decode_steps).
        self.counters = dict.fromkeys(["prompt_tokens", "generated_tokens", "prefill_steps", "prefill_tokens",
                                       "prefill_seconds", "decode_steps", "decode_tokens", "decode_seqs",
                                       "decode_seconds"], 0)

    def tokenize(self, prompt: str | list[int], truncate_prompt_tokens: int | None = None,
                 add_special_tokens: bool = True) -> list[int]:
        """A prompt's token ids (its last ``truncate_prompt_tokens``), or a ``ValueError`` if the engine
        could never serve it (input_processor.py)."""
        return self.input_processor.tokenize(prompt, truncate_prompt_tokens, add_special_tokens)

    def chat_prompt(self, conversation: list[dict], chat_template_kwargs: dict | None = None,
                    tools: list[dict] | None = None, **options) -> list[int]:
        """A conversation's prompt token ids, through the tokenizer's chat template (input_processor.py;
        ``options``: ``add_generation_prompt``, ``continue_final_message``, ``truncate_prompt_tokens``,
        ``documents``)."""
        return self.input_processor.chat_prompt(conversation, chat_template_kwargs, tools, **options)

    def check_sampling_params(self, sampling_params: SamplingParams) -> None:
        """A ``ValueError`` for parameters this engine could never serve (input_processor.py)."""
        self.input_processor.check_sampling_params(sampling_params)

    def check_pooling_params(self, pooling_params: PoolingParams) -> None:
        """A ``ValueError`` for a pooling request this engine could never serve (input_processor.py)."""
        self.input_processor.check_pooling_params(pooling_params)

    def add_request(self, prompt: str | list[int], params: SamplingParams | PoolingParams) -> int:
        """Queue a request; returns its id. The prompt and parameters are checked before anything is
        queued (input_processor.py). With ``PoolingParams`` (runner="pooling") the request is its
        prompt's vector: ``seq.pooled`` once it is finished, and no tokens."""
        seq = self.input_processor.process(prompt, params, self.model_runner.block_size)
        self.scheduler.add(seq)
        self.requests[seq.seq_id] = seq
        self.counters["prompt_tokens"] += seq.num_prompt_tokens
        return seq.seq_id

    def abort_request(self, request_id: int) -> None:
        """Drop a request, every sample of it, now; its KV blocks return to the pool at once."""
        seq = self.requests.pop(request_id, None)
        for sample in seq.group if seq is not None else []:
            if not sample.is_finished:
                self.scheduler.finish(sample, "abort")

    def step(self) -> list[Sequence]:
        """Advance by one model step; returns the sequences that got a token (none when idle, or
        when the step only computed chunks of prompts).

        If the step fails, its requests are aborted (finish_reason "abort") before the error
        propagates: they may have been half computed, and a caller cannot tell which.
        """
        if self.scheduler.is_finished():
            return []
        with interrupts_deferred():
            seqs, blocks_to_copy = self.scheduler.schedule()
        # A step that computes any prompt token is a prefill step (with chunked prefill, decodes too);
        # one that verifies speculative drafts, and nothing of a prompt, is a decode step.
        phase = "decode" if all(seq.num_computed_tokens >= seq.num_prompt_tokens for seq in seqs) else "prefill"
        num_tokens = sum(seq.num_scheduled_tokens for seq in seqs)
        start, generated = time.perf_counter(), self.scheduler.num_generated_tokens
        spec = dict(self.scheduler.spec_decode_counts)
        try:
            out = self.model_runner.run(seqs, blocks_to_copy)
            with interrupts_deferred():
                stepped = self.scheduler.postprocess(seqs, out.token_ids, out.logprobs, out.prompt_logprobs, out.pooled)
            if self.proposer is not None:
                self._propose(stepped)
        except BaseException:
            with interrupts_deferred():
                for seq in seqs:
                    self.abort_request(seq.request_id)
            raise
        counts = self.scheduler.spec_decode_counts
        rejected = (counts["num_draft_tokens"] - spec["num_draft_tokens"]) - \
            (counts["num_accepted_tokens"] - spec["num_accepted_tokens"])
        self.counters[f"{phase}_steps"] += 1
        self.counters[f"{phase}_tokens"] += num_tokens - rejected
        if phase == "decode":
            self.counters["decode_seqs"] += len(seqs)
        self.counters[f"{phase}_seconds"] += time.perf_counter() - start
        self.counters["generated_tokens"] += self.scheduler.num_generated_tokens - generated
        for seq in stepped:
            if all(sample.is_finished for sample in seq.group):
                self.requests.pop(seq.request_id, None)
        return stepped

    def _propose(self, seqs: list[Sequence]) -> None:
        """Drafts for the sequences that just got their tokens, for the next step to verify: at most
        ``num_speculative_tokens``, and none past ``max_tokens`` or ``max_model_len`` (the token after
        the drafts comes free). None for a grammar's sequence (its mask would have to follow each
        draft), and none at all once ``disable_by_batch_size`` sequences run."""
        spec, running = self.config.speculative_config, self.scheduler.running
        seqs = [seq for seq in seqs if not seq.is_finished and seq.grammar is None]
        if spec.disable_by_batch_size is not None and len(running) >= spec.disable_by_batch_size:
            seqs = []  # still called: a proposer may let go of finished sequences' state
        max_drafts = [max(0, min(spec.num_speculative_tokens,
                                 seq.sampling_params.max_tokens - seq.num_completion_tokens - 1,
                                 self.config.max_model_len - seq.num_tokens - 1)) for seq in seqs]
        for seq, drafts in zip(seqs, self.proposer.propose(seqs, max_drafts)):
            seq.spec_token_ids = drafts

    @property
    def failure(self) -> str | None:
        """Why this engine can serve nothing any more (its tensor-parallel group failed), or None."""
        return self.workers.group.failure if self.workers is not None else None

    def has_unfinished_requests(self) -> bool:
        return not self.scheduler.is_finished()

    def stats(self) -> dict:
        return {
            # Requests, not sequences: a request's n samples count once (running if any of them is).
            "num_requests_running": len(running := {seq.request_id for seq in self.scheduler.running}),
            "num_requests_waiting": len({seq.request_id for seq in self.scheduler.waiting} - running),
            "num_kvcache_blocks": len(self.block_manager.blocks),
            "kvcache_tokens": len(self.block_manager.blocks) * self.block_manager.block_size,  # its capacity
            "kvcache_blocks_in_use": self.block_manager.num_used_blocks,
            # Blocks a sliding window left behind, released while their sequences went on (block_manager.py).
            "kvcache_blocks_freed_by_window": self.block_manager.num_window_freed_blocks,
            "num_preemptions": self.scheduler.num_preemptions,
            "prefix_cache_hit_tokens": self.scheduler.prefix_cache_hit_tokens,
            **{f"spec_decode_{name}": count for name, count in self.scheduler.spec_decode_counts.items()},
            **self.counters,
        }
