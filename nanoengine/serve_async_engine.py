"""The async engine: one ``LLMEngine`` shared by many concurrent asyncio callers.

The engine is not thread-safe, so it is built and stepped on one thread of its own. Callers never
touch it: they pass it work (add, abort, read stats) through a thread-safe queue, and the engine
thread runs that work between steps. It sleeps on the queue while it has no requests and steps while
it has any; each step's new tokens go to their request's ``asyncio.Queue`` through
``loop.call_soon_threadsafe``, the one safe way into an event loop from another thread.
Continuous batching does the rest: a request added mid-flight joins the next step.

Failure stays as small as it can. A step that raises has already aborted the requests it ran
(the engine's contract), so exactly those streams get an ``EngineError`` and the rest go on. Work
that raises reports to its caller and leaves the thread running. Death is one notion: if the
thread stops (a bug in its loop), or a failed step left the engine unable to serve anything (its
tensor-parallel group failed: a worker died, or hung past the collectives' bound), ``error`` says
why, every stream and every pending call gets an ``EngineDeadError``, and later calls get one at
once instead of waiting for a thread that will never answer.
"""

import asyncio
import logging
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

import torch

from nanoengine.engine import LLMEngine
from nanoengine.pooler import PoolingParams
from nanoengine.sampling_params import SamplingParams, StructuredOutputsParams

logger = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """A request failed through no fault of its own: the step running it raised."""


class EngineDeadError(EngineError):
    """The engine thread has stopped: nothing more can be served until the process restarts."""


@dataclass
class RequestOutput:
    """What one step gave one sample of a request."""

    index: int  # which of the request's n samples
    token_ids: list[int]  # the tokens sampled since the sample's last output (a step's: one, or more with drafts)
    text: str  # the text they made final; a stop string and what follows it never appear
    logprobs: list[dict[int, float]] | None  # per token, {token_id: logprob}, if the request asked
    finish_reason: str | None  # None while the sample runs; "stop" (EOS, stop string or id) or "length"
    step: int  # the engine step that made it: a request's outputs of one step are one inter-token gap
    # In a sample's first output, if the request asked: per prompt token {token_id: logprob} (None first).
    prompt_logprobs: list[dict[int, float] | None] | None = None
    stop_reason: int | str | None = None  # with "stop": the stop string or stop_token_ids id, as in vLLM
    pooled: torch.Tensor | None = None  # a pooling request's one output: its vector, no tokens (pooler.py)


class RequestStream:
    """The outputs of one or more requests (a batch of prompts, each with ``n`` samples), in the
    order they come: ``async for output in stream``; ``abort()`` to drop them all. An output's
    ``index`` counts samples across the batch: ``prompt_index * n + sample_index``."""

    def __init__(self, engine: "AsyncLLMEngine", loop: asyncio.AbstractEventLoop, num_samples: int):
        self.engine, self.loop = engine, loop
        self.num_unfinished = num_samples  # samples still running: the stream ends when none is
        self.queue: asyncio.Queue[RequestOutput | Exception] = asyncio.Queue()
        # Set by the engine thread once the requests are queued: each request id's prompt index.
        self.prompt_index: dict[int, int] = {}
        self.finished = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        output = await self.queue.get()
        if isinstance(output, Exception):
            self.finished = True
            raise output
        self.num_unfinished -= output.finish_reason is not None
        self.finished = self.num_unfinished == 0
        return output

    def abort(self) -> None:
        """Stop generating (the caller went away or saw a stop string); frees the KV blocks. Idempotent."""
        if not self.finished:
            self.finished = True
            self.engine._submit(lambda: self.engine._abort(self)).add_done_callback(_log_failure)


def _log_failure(future: Future) -> None:
    """Report a fire-and-forget call's exception, which no caller is waiting to see."""
    error = future.exception()  # never cancelled: nobody awaits it
    if error is not None and not isinstance(error, EngineDeadError):  # dead: there is nothing left to abort
        logger.error("engine work failed", exc_info=error)


class AsyncLLMEngine:
    def __init__(self, model: str | None = None, **kwargs):
        """Build ``LLMEngine(model, **kwargs)`` on the engine thread; return once it is ready, or
        raise what building it raised (a ``ValueError`` for a bad option).

        The engine is built on the thread that steps it because OpenMP, which runs torch's and the
        CPU kernels' parallel loops, keeps a pool of worker threads for each thread that starts a
        parallel region. Built on the caller's thread and stepped on this one, the process would
        hold two pools, more OpenMP threads than cores, and libgomp then lets a waiting thread spin
        only a moment before it sleeps: over bench_serving.py's workload the stepping thread and its
        worker slept about 20,000 and 49,000 times, against about 100 and 30 when one thread does both.
        """
        self._inbox: queue.SimpleQueue[tuple[Callable, Future] | None] = queue.SimpleQueue()
        self._streams: dict[int, RequestStream] = {}  # engine thread only
        self._num_steps = 0  # engine thread only
        self.error: str | None = None  # why the engine thread stopped; None while it runs
        # Held to queue work and to mark the thread stopped, so no work slips in after the last drain.
        self._lock = threading.Lock()
        built = Future()
        self._thread = threading.Thread(target=self._run, args=(model, kwargs, built), name="nanoengine",
                                        daemon=True)
        self._thread.start()
        built.result()  # raises what building the engine raised
        # The event loop's thread tokenizes prompts; the engine thread detokenizes completions
        # (stop strings are found in the text), each sequence with a detokenizer of its own.
        self.tokenizer = self.engine.tokenizer

    # -- the callers' side (event loop thread) ----------------------------------------------

    def tokenize(self, prompt: str | list[int], truncate_prompt_tokens: int | None = None,
                 add_special_tokens: bool = True) -> list[int]:
        """The prompt's token ids; a ``ValueError`` if it is empty or too long. Reads the engine only."""
        return self.engine.tokenize(prompt, truncate_prompt_tokens, add_special_tokens)

    def chat_prompt(self, conversation: list[dict], chat_template_kwargs: dict | None = None,
                    tools: list[dict] | None = None, **options) -> list[int]:
        """A conversation's prompt token ids (``LLMEngine.chat_prompt``). Reads the engine only."""
        return self.engine.chat_prompt(conversation, chat_template_kwargs, tools, **options)

    def compile_grammar(self, params: StructuredOutputsParams) -> None:
        """Compile ``params``' grammar into the engine's cache (``GrammarCompiler``, thread-safe), on
        the calling thread; an ``InvalidGrammar`` if the library refuses it.

        The server calls this in a worker thread before it queues the request: compiled on the
        engine thread, as ``add_request`` would otherwise do, a large schema would hold up every
        running request's next token for as long as it takes. Queued after this, the request finds
        its grammar cached.
        """
        self.engine.grammars.compile(params)

    async def add_request(self, prompt_token_ids: list[int], sampling_params: SamplingParams) -> RequestStream:
        """Queue a request; a bad one raises ``ValueError`` here, before any output exists."""
        return await self.add_requests([prompt_token_ids], sampling_params)

    async def add_requests(self, prompts: list[list[int]],
                           sampling_params: SamplingParams | PoolingParams) -> RequestStream:
        """Queue a request per prompt, all or none, with one stream for all their outputs (with
        ``PoolingParams``, one output each: its vector)."""
        n = 1 if isinstance(sampling_params, PoolingParams) else sampling_params.n
        stream = RequestStream(self, asyncio.get_running_loop(), len(prompts) * n)
        try:
            await self._call(lambda: self._add(stream, prompts, sampling_params))
        except asyncio.CancelledError:  # the caller left while the request was being queued
            stream.abort()
            raise
        return stream

    async def stats(self) -> dict:
        return await self._call(self.engine.stats)

    def shutdown(self) -> None:
        self._inbox.put(None)
        self._thread.join(timeout=10)

    def _submit(self, fn: Callable) -> Future:
        """Queue ``fn`` for the engine thread; the future gets its result, or an exception."""
        future = Future()
        with self._lock:
            if self.error is None:
                self._inbox.put((fn, future))
            else:
                future.set_exception(EngineDeadError(self.error))
        return future

    async def _call(self, fn: Callable):
        """Run ``fn`` on the engine thread and await its result (or its exception)."""
        return await asyncio.wrap_future(self._submit(fn))

    # -- the engine thread ------------------------------------------------------------------

    def _add(self, stream: RequestStream, prompts: list[list[int]], sampling_params: SamplingParams) -> None:
        try:
            for index, prompt_token_ids in enumerate(prompts):
                request_id = self.engine.add_request(prompt_token_ids, sampling_params)
                stream.prompt_index[request_id] = index
                self._streams[request_id] = stream
        except BaseException:  # all or none: a prompt refused drops the ones queued before it
            self._abort(stream)
            raise

    def _abort(self, stream: RequestStream) -> None:
        for request_id in stream.prompt_index:
            if self._streams.pop(request_id, None) is not None:
                self.engine.abort_request(request_id)

    def _deliver(self, stream: RequestStream, item: RequestOutput | Exception) -> None:
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
        except RuntimeError:  # the caller's event loop is closed: nobody is listening any more
            self._abort(stream)

    def _run(self, model: str | None, kwargs: dict, built: Future) -> None:
        try:
            self.engine = LLMEngine(model, **kwargs)
        except BaseException as e:
            built.set_exception(e)
            return
        built.set_result(None)
        try:
            reason = self._serve()
        except BaseException as e:  # a bug in the loop itself: say so rather than hang every caller
            logger.exception("the engine thread died")
            reason = f"the engine thread died: {e!r}"
        with self._lock:
            self.error = reason
        while not self._inbox.empty():  # nothing can be queued now; fail what already was
            if (item := self._inbox.get()) is not None and item[1].set_running_or_notify_cancel():
                item[1].set_exception(EngineDeadError(reason))
        streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            self._deliver(stream, EngineDeadError(reason))

    def _serve(self) -> str:
        """Serve until shut down, or until the engine can serve nothing more; returns why it stopped."""
        while True:
            # Block only when idle: with requests in flight, take what has arrived and step.
            work = [self._inbox.get()] if not self.engine.has_unfinished_requests() else []
            while not self._inbox.empty():
                work.append(self._inbox.get())
            for item in work:
                if item is None:
                    return "the engine was shut down"
                fn, future = item
                if future.set_running_or_notify_cancel():  # False: the awaiting caller was cancelled
                    try:
                        future.set_result(fn())
                    except Exception as e:
                        future.set_exception(e)
            if not self.engine.has_unfinished_requests():
                continue
            try:
                seqs = self.engine.step()
            except Exception as e:
                # The step aborted its own requests: theirs are the streams whose request is gone.
                logger.exception("a step failed; the requests it was running are aborted")
                for request_id in [i for i in self._streams if i not in self.engine.requests]:
                    if (stream := self._streams.get(request_id)) is not None:  # None: failed with a batch-mate
                        self._abort(stream)  # its caller stops reading: the batch's other requests go too
                        self._deliver(stream, EngineError(f"the step running this request failed: {e!r}"))
                if self.engine.failure is not None:
                    return f"the engine cannot serve: {self.engine.failure}"
                continue
            self._num_steps += 1
            for seq in seqs:
                if (stream := self._streams.get(seq.request_id)) is not None and seq.pooling_params is not None:
                    self._deliver(stream, RequestOutput(stream.prompt_index[seq.request_id], [], "", None,
                                                        seq.finish_reason, self._num_steps, pooled=seq.pooled))
                elif stream is not None:
                    new = seq.num_new_tokens  # 1, or more where speculative drafts were accepted
                    logprobs = None if seq.logprobs is None else seq.logprobs[-new:]
                    index = stream.prompt_index[seq.request_id] * seq.sampling_params.n + seq.sample_index
                    first = seq.num_completion_tokens == new
                    self._deliver(stream, RequestOutput(index, seq.token_ids[-new:], seq.detokenizer.last_deltas(new),
                                                        logprobs, seq.finish_reason, self._num_steps,
                                                        seq.prompt_logprobs if first else None, seq.stop_reason))
            for request_id in {seq.request_id for seq in seqs if all(s.is_finished for s in seq.group)}:
                self._streams.pop(request_id, None)
