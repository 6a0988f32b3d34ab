"""The async engine: one ``LLMEngine`` shared by many concurrent asyncio callers.

The engine is not thread-safe, so it lives on one thread of its own. Callers never touch it:
they pass it work (add, abort, read stats) through a thread-safe queue, and the engine thread
runs that work between steps. It sleeps on the queue while it has no requests and steps while
it has any; each step's new tokens go to their request's ``asyncio.Queue`` through
``loop.call_soon_threadsafe``, the one safe way into an event loop from another thread.
Continuous batching does the rest: a request added mid-flight joins the next step.
"""

import asyncio
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

from nanoengine.engine import LLMEngine
from nanoengine.sampling_params import SamplingParams


@dataclass
class RequestOutput:
    token_ids: list[int]  # the tokens sampled since the last output (one per step)
    finish_reason: str | None  # None while the request runs; "stop" (EOS) or "length" at its end


class RequestStream:
    """One request's outputs, in order: ``async for output in stream``; ``abort()`` to drop it."""

    def __init__(self, engine: "AsyncLLMEngine", loop: asyncio.AbstractEventLoop):
        self.engine, self.loop = engine, loop
        self.queue: asyncio.Queue[RequestOutput | Exception] = asyncio.Queue()
        self.request_id: int | None = None  # set by the engine thread once the request is queued
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
        self.finished = output.finish_reason is not None
        return output

    def abort(self) -> None:
        """Stop generating (the caller went away or saw a stop string); frees the KV blocks. Idempotent."""
        if not self.finished:
            self.finished = True
            self.engine._submit(lambda: self.engine._abort(self))


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        # The tokenizer belongs to the event loop's thread (prompts in, text out); the engine
        # thread only ever sees token ids.
        self.tokenizer = engine.tokenizer
        self._inbox: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._streams: dict[int, RequestStream] = {}  # engine thread only
        self._thread = threading.Thread(target=self._run, name="nanoengine", daemon=True)
        self._thread.start()

    # -- the callers' side (event loop thread) ----------------------------------------------

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """The prompt's token ids; a ``ValueError`` if it is empty or too long. Reads the engine only."""
        return self.engine.tokenize(prompt)

    async def add_request(self, prompt_token_ids: list[int], sampling_params: SamplingParams) -> RequestStream:
        """Queue a request; a bad one raises ``ValueError`` here, before any output exists."""
        stream = RequestStream(self, asyncio.get_running_loop())
        try:
            await self._call(lambda: self._add(stream, prompt_token_ids, sampling_params))
        except asyncio.CancelledError:  # the caller left while the request was being queued
            stream.abort()
            raise
        return stream

    async def stats(self) -> dict:
        return await self._call(self.engine.stats)

    def shutdown(self) -> None:
        self._inbox.put(None)
        self._thread.join(timeout=10)

    def _submit(self, fn: Callable[[], None]) -> None:
        self._inbox.put(fn)

    async def _call(self, fn: Callable):
        """Run ``fn`` on the engine thread and await its result (or its exception)."""
        future = Future()

        def run():
            if not future.set_running_or_notify_cancel():  # the awaiting caller was cancelled
                return
            try:
                future.set_result(fn())
            except Exception as e:
                future.set_exception(e)
        self._submit(run)
        return await asyncio.wrap_future(future)

    # -- the engine thread ------------------------------------------------------------------

    def _add(self, stream: RequestStream, prompt_token_ids: list[int], sampling_params: SamplingParams) -> None:
        stream.request_id = self.engine.add_request(prompt_token_ids, sampling_params)
        self._streams[stream.request_id] = stream

    def _abort(self, stream: RequestStream) -> None:
        if self._streams.pop(stream.request_id, None) is not None:
            self.engine.abort_request(stream.request_id)

    def _deliver(self, stream: RequestStream, item: RequestOutput | Exception) -> None:
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
        except RuntimeError:  # the caller's event loop is closed: nobody is listening any more
            self._abort(stream)

    def _run(self) -> None:
        while True:
            # Block only when idle: with requests in flight, take what has arrived and step.
            work = [self._inbox.get()] if not self.engine.has_unfinished_requests() else []
            while not self._inbox.empty():
                work.append(self._inbox.get())
            for fn in work:
                if fn is None:
                    return
                fn()
            if not self.engine.has_unfinished_requests():
                continue
            try:
                seqs, _ = self.engine.step()
            except Exception as e:  # a bug, not a bad request: fail every request rather than hang them
                for stream in list(self._streams.values()):
                    self._abort(stream)
                    self._deliver(stream, e)
                continue
            for seq in seqs:
                stream = self._streams.get(seq.seq_id)
                if stream is None:
                    continue
                if seq.is_finished:
                    del self._streams[seq.seq_id]
                self._deliver(stream, RequestOutput([seq.token_ids[-1]], seq.finish_reason))
