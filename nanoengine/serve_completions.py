"""OpenAI's responses: a request's samples, as they come from the engine, turned into OpenAI's JSON.

``generate`` answers a completions or chat request for one or more prompts: it queues them on the
``AsyncLLMEngine`` and shapes what comes back (each sample's new tokens, their text and logprobs;
several tokens at once from a step that accepted speculative drafts) into a whole response or a
stream of server-sent events in OpenAI's chunk format, one choice per prompt and sample. With
tools, each chat choice's text is split into content and tool calls (openai_tool_parser.py). However a
response ends (done, the client gone, an error), its requests are aborted, so the KV blocks of a
client that disconnects are freed at once. serve.py routes requests here.
"""

import asyncio
import functools
import json
import time
import uuid
from dataclasses import replace
from itertools import accumulate
from typing import AsyncIterator, Awaitable

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from nanoengine.serve_async_engine import AsyncLLMEngine, EngineError, RequestStream
from nanoengine.serve_metrics import RequestClock
from nanoengine.openai_protocol import BadRequest, OpenAIRequest, error_body, sampling_params
from nanoengine.openai_prompts import Echo, vllm_prompt_logprobs
from nanoengine.sampling_params import StructuredOutputsParams
from nanoengine.openai_tool_calls import ToolChoice


class EventStream(StreamingResponse):
    """Server-sent events that abort their request however the response ends, a client gone included."""

    def __init__(self, events: AsyncIterator[str], stream: RequestStream):
        super().__init__(events, media_type="text/event-stream")
        self.stream = stream

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.stream.abort()


async def unless_disconnected(request: Request, work: Awaitable[Response]) -> Response:
    """Await ``work``, cancelling it (and so aborting its request) if the client disconnects first.

    FastAPI has read the body, so the next ASGI message is the disconnect: waiting for it costs
    nothing, where polling ``request.is_disconnected()`` would need a timer.
    """
    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
    work, disconnect = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait([work, disconnect], return_when=asyncio.FIRST_COMPLETED)
    finally:
        work.cancel()  # a no-op once it is done; otherwise its request is aborted as it unwinds
        disconnect.cancel()
    if work in done:
        return work.result()
    return Response(status_code=499)  # nginx's "client closed request": nobody is left to read it



async def generate(engine: AsyncLLMEngine, model_name: str, request: Request, req: OpenAIRequest,
                   prompt_ids: list[list[int]], max_tokens: int, chat: bool, logprobs: int | None,
                   clock: RequestClock, prompt_logprobs: int | None = None, echo: Echo | None = None,
                   structured: StructuredOutputsParams | None = None, tools: ToolChoice | None = None):
    """Answer a request for one or more prompts (a completions batch): a choice per prompt and
    sample, numbered ``prompt_index * n + sample_index``, as OpenAI and vLLM do."""
    if req.prompt_logprobs is not None and req.stream:  # as in vLLM (echo's own go in the first chunk)
        raise BadRequest("prompt_logprobs is not available with stream: true", "prompt_logprobs")
    params = replace(sampling_params(req, max_tokens, logprobs), prompt_logprobs=prompt_logprobs,
                     structured_outputs=structured)
    if tools is not None and tools.forced:  # the grammar ends a forced call: a stop string (LangChain sends
        params = replace(params, stop=[])  # some) would only cut its arguments, as OpenAI's never are
    stream = await engine.add_requests(prompt_ids, params)
    head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{req.request_id or uuid.uuid4().hex}", "created": int(time.time()),
            "model": model_name}
    # The reply's role: the assistant's, or, with no generation prompt, the last message's, which the
    # model goes on with (as vLLM answers).
    role = "assistant" if not chat or req.add_generation_prompt else req.messages[-1].role
    num_choices = len(prompt_ids) * req.n
    num_tokens = [0] * num_choices  # per choice
    scored = [None] * len(prompt_ids)  # per prompt, the engine's prompt_logprobs, if asked
    # Per chat choice, with tools: its text split into content and tool calls (openai_tool_parser.py).
    parsers = [tools.parser() if tools else None for _ in range(num_choices)]

    def usage() -> dict:
        n, num_prompt_tokens = sum(num_tokens), sum(map(len, prompt_ids))
        return {"prompt_tokens": num_prompt_tokens, "completion_tokens": n, "total_tokens": num_prompt_tokens + n}

    token_texts = {}  # each token's text, decoded once a response: top logprobs repeat the same tokens

    def token_text(token_id: int) -> str:
        if (text := token_texts.get(token_id)) is None:
            text = token_texts[token_id] = (f"token_id:{token_id}" if req.return_tokens_as_token_ids  # vLLM's
                                            else engine.tokenizer.decode([token_id]))
        return text

    def choice(index: int, text: str, finish_reason: str | None, token_logprobs: list | None, offset: int,
               stop_reason: int | str | None = None) -> dict:
        """A choice of a response, or of a chunk when streaming; ``offset``: where its first token's
        text starts, the length of the choice's tokens' texts before it; ``stop_reason``: vLLM's."""
        logprobs_json = None
        if logprobs is not None and token_logprobs:
            logprobs_json = (chat_logprobs(token_text, token_logprobs, logprobs) if chat
                             else completion_logprobs(token_text, token_logprobs, offset))
        calls = None
        if (parser := parsers[index]) is not None:  # streamed: the calls' deltas; whole: the calls
            text, calls = parser.feed(text, final=finish_reason is not None or not req.stream)
            calls = calls if req.stream else parser.calls
            # "tool_calls" for whole calls: arguments a stop string cut (in "auto") say "stop"
            finish_reason = "tool_calls" if finish_reason == "stop" and parser.calls and parser.whole else finish_reason
        if chat and req.stream:
            content = {"delta": {"content": text} if text else {}}
            content["delta"].update({"tool_calls": calls} if calls else {})
        else:
            message = {"role": role, "content": text if text or not tools or not tools.forced else None,
                       "refusal": None}  # a forced call's output is calls only: no text, none cut short either
            message.update({"content": text or None, "tool_calls": calls} if calls else {})
            content = {"message": message} if chat else {"text": text}
        return {"index": index, "logprobs": logprobs_json, "finish_reason": finish_reason, "stop_reason": stop_reason,
                **content}

    async def whole() -> Response:
        outs, finish_reason = [], None
        try:
            async for out in stream:
                clock.output(out.step)
                outs.append(out)
                finish_reason = out.finish_reason if out.index == 0 and out.finish_reason else finish_reason
        except EngineError:
            clock.finish("error")
            raise
        finally:
            stream.abort()
            clock.finish(finish_reason or "abort")  # unfinished: the client left
        # In a worker thread: echoing the prompts, the texts of n samples' top logprobs and their JSON
        # (megabytes) would hold up every other stream, and /health, for seconds on the event loop.
        return await asyncio.to_thread(respond, outs)

    def respond(outs: list) -> Response:
        texts, token_logprobs = [[] for _ in range(num_choices)], [[] for _ in range(num_choices)]
        finish_reasons, stop_reasons = [None] * num_choices, [None] * num_choices
        for out in outs:
            if out.prompt_logprobs is not None:
                scored[out.index // req.n] = out.prompt_logprobs
            out = echo(out) if echo is not None else out
            texts[out.index].append(out.text)
            num_tokens[out.index] += len(out.token_ids)
            finish_reasons[out.index], stop_reasons[out.index] = out.finish_reason, out.stop_reason
            token_logprobs[out.index] += out.logprobs or []
        choices = [choice(i, "".join(texts[i]), finish_reasons[i], token_logprobs[i], 0, stop_reasons[i])
                   for i in range(num_choices)]
        if req.prompt_logprobs is not None:  # vLLM's extension: in each choice, or in a chat response
            shaped = [vllm_prompt_logprobs(engine.tokenizer, s, prompt_logprobs) for s in scored]
            if chat:
                head["prompt_logprobs"] = shaped[0]
            else:
                for c in choices:
                    c["prompt_logprobs"] = shaped[c["index"] // req.n]
        return json_response({**head, "object": "chat.completion" if chat else "text_completion", "usage": usage(),
                              "system_fingerprint": None}, choices)  # as vLLM sends it

    if not req.stream:
        return await unless_disconnected(request, whole())

    async def events() -> AsyncIterator[str]:
        obj = "chat.completion.chunk" if chat else "text_completion"

        # With include_usage, every chunk but the last (usage, no choices) says ``usage: null``, as
        # OpenAI's do; with vLLM's continuous_usage_stats too, each says the usage so far.
        include_usage = bool((req.stream_options or {}).get("include_usage"))
        continuous = include_usage and bool(req.stream_options.get("continuous_usage_stats"))

        def event(choice: dict) -> str:
            extra = {"usage": usage() if continuous else None} if include_usage else {}
            return f"data: {json.dumps({**head, 'object': obj, 'choices': [choice], **extra})}\n\n"

        if chat:
            for i in range(req.n):
                yield event({"index": i, "logprobs": None, "finish_reason": None, "delta": {"role": role}})
        # Per choice, where its next token's text starts: counted by the tokens, as a whole response
        # counts, not by the text streamed so far, which lags behind them while a stop string may
        # be beginning or a character is split across tokens.
        offsets, finish_reason = [0] * num_choices, "abort"  # until sample 0 ends: the client may leave first
        try:
            async for out in stream:
                clock.output(out.step)
                if out.finish_reason and out.index == 0:
                    finish_reason = out.finish_reason
                out = echo(out) if echo is not None else out
                num_tokens[out.index] += len(out.token_ids)
                if out.text or out.finish_reason or out.logprobs:
                    part = choice(out.index, out.text, out.finish_reason, out.logprobs, offsets[out.index],
                                  out.stop_reason)
                    if part["logprobs"] is not None and not chat:
                        offsets[out.index] += sum(map(len, part["logprobs"]["tokens"]))
                    if not chat or part["delta"] or part["finish_reason"] or part["logprobs"]:
                        yield event(part)  # not a chunk of nothing (text the tool parser holds), as vLLM
        except EngineError as e:  # the status line has gone out: the error can only be an event
            finish_reason = "error"
            yield f"data: {json.dumps(error_body(str(e), 'server_error'))}\n\n"
        else:
            if include_usage:
                yield f"data: {json.dumps({**head, 'object': obj, 'choices': [], 'usage': usage()})}\n\n"
        finally:
            clock.finish(finish_reason)
        yield "data: [DONE]\n\n"

    return EventStream(events(), stream)


_dumps = functools.partial(json.dumps, ensure_ascii=False, allow_nan=False, separators=(",", ":"))  # Starlette's


def json_response(fields: dict, choices: list[dict]) -> Response:
    """A response's JSON, encoded one choice at a time: ``json.dumps`` holds the interpreter's lock
    for as long as it runs, so on the megabytes of n samples' echoed logprobs one call would stall
    the event loop for seconds from any thread; between two choices the loop gets its turn."""
    encoded = [_dumps(c) for c in choices]  # a Python loop: the lock may change hands between calls
    return Response(f'{_dumps(fields)[:-1]},"choices":[{",".join(encoded)}]}}', media_type="application/json")


def completion_logprobs(token_text, logprobs: list[dict[int, float | None]], offset: int) -> dict:
    """The completions API's shape: each token's text (``token_text``) and logprob, its top
    alternatives by text, and where each token's text starts (``offset``: the length of the choice's
    text before them). An echoed prompt's first token has no logprob (nothing before it predicts
    it): its entry is ``{token_id: None}``, and its logprob and top alternatives are null."""
    tokens = [token_text(next(iter(top))) for top in logprobs]
    starts = list(accumulate(map(len, tokens), initial=offset))[:-1]
    token_logprobs = [next(iter(top.values())) for top in logprobs]
    return {"tokens": tokens, "token_logprobs": token_logprobs,
            "top_logprobs": [None if lp is None else {token_text(t): v for t, v in top.items()}
                             for top, lp in zip(logprobs, token_logprobs)],
            "text_offset": starts}


def chat_logprobs(token_text, logprobs: list[dict[int, float]], num_top: int) -> dict:
    """The chat API's shape: per token its text (``token_text``), bytes, logprob and its ``num_top``
    best alternatives."""
    def entry(token_id: int, logprob: float) -> dict:
        text = token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
    return {"content": [{**entry(*next(iter(top.items()))),
                         "top_logprobs": [entry(*item) for item in sorted(top.items(), key=lambda x: -x[1])[:num_top]]}
                        for top in logprobs]}
