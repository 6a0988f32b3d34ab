"""What a request asks its output to follow, in whichever of the API's forms it asks: OpenAI's
``response_format`` (``json_object``, ``json_schema``) and a ``tool_choice`` that forces a call,
vLLM's ``structured_outputs`` and its older ``guided_json``, ``guided_regex``, ``guided_choice`` and
``guided_grammar``. Each becomes one ``StructuredOutputsParams``; a request may give one of them at
most, since each constrains the whole output.

The grammar is compiled here, in a worker thread, before serve.py queues the request: compiled on
the engine thread, as ``LLMEngine.add_request`` would otherwise do, a large schema would stall
every running request's next token for as long as it takes (``AsyncLLMEngine.compile_grammar``).
A grammar the library refuses is a 400 that names the field and quotes the library's reason.
"""

import asyncio

from nanoengine.serve_async_engine import AsyncLLMEngine
from nanoengine.openai_protocol import BadRequest, OpenAIRequest
from nanoengine.sampling_params import StructuredOutputsParams
from nanoengine.structured_output import InvalidGrammar
from nanoengine.openai_tool_calls import ToolChoice, arguments_schema


def _requested(req: OpenAIRequest, tool_grammar: str | None) -> dict[str, tuple[dict, str]]:
    """Each constraining field the request sets: ``StructuredOutputsParams``' keywords, and the
    part of the request its grammar comes from (what a 400 names if the library refuses it)."""
    asked = {}
    if req.response_format is not None and req.response_format.type == "json_object":
        asked["response_format"] = {"json_object": True}, "response_format"
    elif req.response_format is not None and req.response_format.type == "json_schema":
        schema = req.response_format.json_schema.schema_
        if not req.response_format.json_schema.strict:  # keywords llguidance lacks (uniqueItems) are ignored
            schema = {**schema, "x-guidance": {"lenient": True}}  # merged with the compile's own options
        asked["response_format"] = {"json": schema}, "response_format.json_schema.schema"
    if req.structured_outputs is not None:
        keywords = req.structured_outputs.model_dump(exclude_defaults=True, by_alias=True)
        asked["structured_outputs"] = keywords, f"structured_outputs.{next(iter(keywords), '')}"
    for kind in ("json", "regex", "choice", "grammar"):
        if (value := getattr(req, f"guided_{kind}")) is not None:
            asked[f"guided_{kind}"] = {kind: value}, f"guided_{kind}"
    if tool_grammar is not None:  # a forced call is the whole output: response_format is for text replies
        asked.pop("response_format", None)  # (OpenAI's Agents SDK sends both), as OpenAI takes them
        asked["tool_choice"] = {"grammar": tool_grammar}, "tools (a function's parameters)"
    return asked


async def structured_outputs(engine: AsyncLLMEngine, req: OpenAIRequest,
                             tools: ToolChoice | None = None) -> StructuredOutputsParams | None:
    """The request's constraint, its grammar compiled (in a worker thread); None if it has none.
    With ``tools`` forcing a call (openai_tool_calls.py), their grammar, each function's arguments schema
    first compiled alone: so that one no JSON value matches is a 400 that names it, rather than
    a call the grammar can begin and never end."""
    for function in (tool["function"] for tool in (tools.forced if tools is not None else [])):
        try:
            await asyncio.to_thread(engine.compile_grammar, StructuredOutputsParams(json=arguments_schema(function)))
        except InvalidGrammar as e:
            raise BadRequest(f"tools: the parameters of {function['name']!r} are not a JSON schema llguidance "
                             f"accepts: {e.reason}", "tools") from None
    asked = _requested(req, tools.grammar if tools is not None else None)
    if len(asked) > 1:
        raise BadRequest(f"{' and '.join(asked)} each constrain the output: give one of them at most",
                         next(iter(asked)))
    if not asked:
        return None
    [(field, (keywords, source))] = asked.items()
    try:
        params = StructuredOutputsParams(**keywords)
        await asyncio.to_thread(engine.compile_grammar, params)
    except InvalidGrammar as e:
        param = "tools" if field == "tool_choice" else field
        raise BadRequest(f"{source} is not a grammar llguidance accepts: {e.reason}", param) from None
    except ValueError as e:  # StructuredOutputsParams' own checks, which name its fields
        raise BadRequest(str(e) if field == "structured_outputs" else f"{field}: {e}", field) from None
    return params
