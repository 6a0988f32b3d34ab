"""``POST /v1/responses``, OpenAI's Responses API, served by the chat endpoint, and ``GET`` and
``DELETE /v1/responses/{id}`` for the responses it keeps.

A request becomes a chat request (openai_responses.py) and goes down the chat endpoint's own path
(serve.py: its checks, prompt, tools, grammar and ``generate``); what comes back, a chat completion
or its chunks, is reshaped here into a response object (a ``message`` of ``output_text``, a
``function_call`` per tool call) or OpenAI's stream of typed, numbered events. Reading chat's JSON
keeps one path to the engine (abort on disconnect, metrics, errors) for the price of decoding each
chunk once more. A response kept (``store``) holds its input items, those of the responses it
continues included: ``previous_response_id`` finds a conversation in one record, which outlives
the records before it. ``ResponseStore`` bounds them by count and size; a 404 for an id it lacks.
"""

import asyncio
import json
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from nanoengine.serve_limits import error_response
from nanoengine.openai_chat_protocol import ChatCompletionRequest
from nanoengine.openai_protocol import BadRequest
from nanoengine.openai_responses import FunctionChoice, ResponsesRequest, chat_request, in_responses_terms
from nanoengine.serve_completions import EventStream

# An agent's conversation is one response per turn, each record holding the whole conversation,
# which max_model_len bounds (4,096 tokens: some 20-40 KB of JSON with its output). 1,024 records
# keep the recent turns of hundreds of conversations; 64 MiB bounds the worst case (a record of
# echoed tools and logprobs) at a small part of what the model and its KV cache hold.
MAX_STORED_RESPONSES = 1024
MAX_STORED_RESPONSES_BYTES = 64 << 20


@dataclass
class StoredResponse:
    response: dict
    items: list[dict]  # the input it answered, an earlier response's input and output first
    size: int  # bytes of the two as JSON


class ResponseStore:
    """The responses kept for ``previous_response_id`` and ``GET``: at most ``max_responses`` of
    them and ``max_bytes`` of their JSON, the oldest evicted first; a response larger than
    ``max_bytes`` alone is not kept. One per app; ``put`` runs in worker threads, hence the lock."""

    def __init__(self, max_responses: int = MAX_STORED_RESPONSES, max_bytes: int = MAX_STORED_RESPONSES_BYTES):
        self.max_responses, self.max_bytes = max_responses, max_bytes
        self.responses: OrderedDict[str, StoredResponse] = OrderedDict()
        self.size = 0
        self.lock = threading.Lock()

    def put(self, response: dict, items: list[dict]) -> None:
        size = len(json.dumps(response)) + len(json.dumps(items))  # the encoding: outside the lock
        if size > self.max_bytes:
            return
        with self.lock:
            self.responses[response["id"]] = StoredResponse(response, items, size)
            self.size += size
            while len(self.responses) > self.max_responses or self.size > self.max_bytes:
                self.size -= self.responses.popitem(last=False)[1].size

    def get(self, response_id: str) -> StoredResponse | None:
        with self.lock:
            return self.responses.get(response_id)

    def delete(self, response_id: str) -> bool:
        with self.lock:
            stored = self.responses.pop(response_id, None)
            self.size -= stored.size if stored else 0
        return stored is not None


def echoed(req: ResponsesRequest, response_id: str, model_name: str) -> dict:
    """The fields of a response object that are not its output: its id and the request's settings."""
    dump = dict(mode="json", by_alias=True, exclude_none=True)
    return {"id": response_id, "object": "response", "created_at": int(time.time()), "model": model_name,
            **req.model_dump(include={"instructions", "previous_response_id", "max_output_tokens", "user",
                                      "safety_identifier", "prompt_cache_key"}),
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "top_p": 1.0 if req.top_p is None else req.top_p, "top_logprobs": req.top_logprobs or 0,
            "tools": [tool.model_dump(**dump) for tool in req.tools or []],
            "tool_choice": req.tool_choice.model_dump(**dump) if isinstance(req.tool_choice, FunctionChoice)
            else req.tool_choice or "auto",
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "text": {"format": {"type": "text"}, **(req.text.model_dump(**dump) if req.text else {})},
            "reasoning": req.reasoning.model_dump(**dump) if req.reasoning else None,
            "metadata": req.metadata or {}, "store": req.store is not False, "service_tier": "default",
            "truncation": "disabled", "background": False, "max_tool_calls": None, "error": None}


class ResponseBuilder:
    """One response's output items, built as chat's text and tool calls arrive (a message is open
    until a call begins, a call until the next one or the end), and, streamed, the events that
    say so, encoded as they happen."""

    def __init__(self, head: dict, stream: bool):
        self.head, self.stream = head, stream
        self.output: list[dict] = []
        self.open: dict | None = None  # the item being written
        self.logprobs: list[dict] = []  # the tokens' since the last text (a text the tool parser holds back)
        self.events: list[str] = []
        self.sequence_number = 0

    def emit(self, type: str, **fields) -> None:
        if self.stream:
            data = json.dumps({"type": type, "sequence_number": self.sequence_number, **fields})
            self.events.append(f"event: {type}\ndata: {data}\n\n")
            self.sequence_number += 1

    def drain(self) -> list[str]:
        events, self.events = self.events, []
        return events

    def where(self) -> dict:
        return {"item_id": self.open["id"], "output_index": len(self.output) - 1}

    def add(self, item: dict) -> None:
        self.close("completed")
        self.output.append(item)
        self.open = item
        self.emit("response.output_item.added", output_index=len(self.output) - 1, item=item)

    def feed(self, delta: dict, logprobs: list[dict]) -> None:
        """A chat chunk's delta and its tokens' logprobs, or a whole message (all of it at once)."""
        self.logprobs += logprobs
        if text := delta.get("content"):
            self.text(text)
        for call in delta.get("tool_calls") or []:
            if "id" in call:  # a call's first delta, or a whole call
                self.call(call["id"], call["function"]["name"])
            if arguments := call["function"].get("arguments"):
                self.arguments(arguments)

    def text(self, delta: str) -> None:
        logprobs, self.logprobs = self.logprobs, []
        if self.open is None or self.open["type"] != "message":
            self.add({"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant",
                      "status": "in_progress", "content": []})
            self.open["content"].append({"type": "output_text", "text": "", "annotations": [], "logprobs": []})
            self.emit("response.content_part.added", **self.where(), content_index=0, part=self.open["content"][0])
        part = self.open["content"][0]
        part["text"] += delta
        part["logprobs"] += logprobs
        self.emit("response.output_text.delta", **self.where(), content_index=0, delta=delta, logprobs=logprobs)

    def call(self, call_id: str, name: str) -> None:
        self.add({"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "call_id": call_id, "name": name,
                  "arguments": "", "status": "in_progress"})

    def arguments(self, delta: str) -> None:
        self.open["arguments"] += delta
        self.emit("response.function_call_arguments.delta", **self.where(), delta=delta)

    def close(self, status: str) -> None:
        if (item := self.open) is None:
            return
        item["status"] = status
        if item["type"] == "message":
            part = item["content"][0]
            self.emit("response.output_text.done", **self.where(), content_index=0, text=part["text"],
                      logprobs=part["logprobs"])
            self.emit("response.content_part.done", **self.where(), content_index=0, part=part)
        else:
            self.emit("response.function_call_arguments.done", **self.where(), arguments=item["arguments"])
        self.emit("response.output_item.done", output_index=len(self.output) - 1, item=item)
        self.open = None

    def response(self, status: str, **fields) -> dict:
        return {**self.head, "status": status, "output": self.output, "incomplete_details": None, "usage": None,
                **fields}

    def finish(self, finish_reason: str | None, usage: dict) -> dict:
        """The response as it ended: ``incomplete`` if the output hit its bound ("length")."""
        status = "incomplete" if finish_reason == "length" else "completed"
        if not self.output:  # nothing written (or a forced call cut before its name): an empty message
            self.text("")
        self.close(status)
        usage = {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
                 "total_tokens": usage["total_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                 "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0}}  # the prefix cache's: uncounted
        response = self.response(status, usage=usage, completed_at=int(time.time()),
                                 incomplete_details={"reason": "max_output_tokens"} if status == "incomplete" else None)
        self.emit(f"response.{status}", response=response)
        return response


def whole(builder: ResponseBuilder, body: bytes, keep: Callable[[dict], None]) -> Response:
    """A chat completion's JSON as a response object (in a worker thread: logprobs can make it long)."""
    completion = json.loads(body)
    choice = completion["choices"][0]
    builder.feed(choice["message"], (choice["logprobs"] or {}).get("content") or [])
    response = builder.finish(choice["finish_reason"], completion["usage"])
    keep(response)
    return JSONResponse(response)


async def events(builder: ResponseBuilder, chunks: AsyncIterator[str], keep: Callable[[dict], None]):
    """Chat's chunks as the Responses API's events; the last says the response, as kept."""
    for kind in ("response.created", "response.in_progress"):
        builder.emit(kind, response=builder.response("in_progress"))
    finish_reason, usage = None, None
    async for chunk in chunks:  # to the end, [DONE] included: chat's stream ends its request's metrics there
        if (data := chunk.removeprefix("data: ").strip()) == "[DONE]":
            if finish_reason != "error":
                await asyncio.to_thread(keep, builder.finish(finish_reason, usage))
        elif "error" in (body := json.loads(data)):  # the step failed: nothing is kept
            finish_reason = "error"
            builder.emit("response.failed", response=builder.response("failed", error={
                "code": "server_error", "message": body["error"]["message"]}))
        else:
            usage = body.get("usage") or usage
            for choice in body["choices"]:
                builder.feed(choice["delta"], (choice["logprobs"] or {}).get("content") or [])
                finish_reason = choice["finish_reason"] or finish_reason
        for event in builder.drain():
            yield event


def responses_router(model_name: str, chat: Callable[[ChatCompletionRequest, Request], Awaitable[Response]],
                     store: ResponseStore) -> APIRouter:
    """The Responses API's routes; ``chat``: serve.py's chat completions endpoint, which serves them."""
    router = APIRouter()

    def not_found(response_id: str, param: str | None = None) -> Response:
        return error_response(f"Response with id '{response_id}' not found.", 404, param=param)

    @router.post("/v1/responses")
    async def create_response(req: ResponsesRequest, request: Request):
        earlier = []
        if req.previous_response_id is not None:
            if (stored := store.get(req.previous_response_id)) is None:
                return not_found(req.previous_response_id, "previous_response_id")
            earlier = stored.items + stored.response["output"]
        chat_req = chat_request(req, earlier)
        try:
            answer = await chat(chat_req, request)
        except BadRequest as e:
            raise in_responses_terms(e) from None
        items = earlier + [item.model_dump(mode="json", exclude_none=True) for item in req.input_items]
        keep = (lambda response: store.put(response, items)) if req.store is not False else (lambda response: None)
        builder = ResponseBuilder(echoed(req, f"resp_{uuid.uuid4().hex}", model_name), bool(req.stream))
        if not req.stream:
            if answer.status_code != 200:  # the client left (499)
                return answer
            return await asyncio.to_thread(whole, builder, answer.body, keep)
        return EventStream(events(builder, answer.body_iterator, keep), answer.stream)

    @router.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str):
        stored = store.get(response_id)
        return JSONResponse(stored.response) if stored else not_found(response_id)

    @router.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        if not store.delete(response_id):
            return not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    return router
