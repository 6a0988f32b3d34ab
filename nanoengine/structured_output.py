"""Structured output: the tokens a request may sample next, from a grammar its output must follow.

A request's ``StructuredOutputsParams`` (a JSON schema, a regex, a choice, a grammar) becomes a
grammar over this model's tokenizer (llguidance, llama.cpp's backend and one of vLLM's; why this
one and not xgrammar is measured in docs/structured-output.md). Each sample carries a *matcher*,
the grammar's parser at the sample's position:

- before a sampling step, every constrained row's matcher writes a bitmask over the vocabulary
  (``allowed_tokens``: bit ``j`` of 32-bit word ``i`` allows token ``32 i + j``, unpacked to a mask);
  the sampler masks every other token to -inf (logits_processors.py), so an unconstrained row costs
  nothing;
- after it, ``Scheduler.postprocess`` advances the matcher by the token that landed, the one place
  every token lands; a matcher whose grammar cannot go on (a closed JSON object, a choice
  spelled out, or a stop token taken) has *stopped*, which finishes the sequence ("stop").

A sample forked at a request's first token gets a copy of the matcher (``Sequence.fork``). A
preempted sequence keeps its tokens and its matcher, whose state is that of those tokens, so its
recompute needs nothing from here.

Compiling is the only slow part (milliseconds for a typical schema, far more for a large one), and
the server does it in a worker thread before it queues the request (``AsyncLLMEngine.compile_grammar``),
so the engine thread, which steps every other request, only ever finds the grammar cached and copies
its matcher (tens of microseconds). The library releases the GIL while it compiles.
"""

import json
import threading

import torch

from nanoengine.sampling_params import StructuredOutputsParams


def _llguidance():
    """The grammar library, imported at the first constrained request, not with nanoengine: it is
    optional, and importing its torch helpers takes seconds an engine without grammars never needs."""
    try:
        import llguidance
        import llguidance.gbnf_to_lark
        import llguidance.hf
        import llguidance.torch
    except ImportError:
        raise ValueError('structured_outputs needs llguidance: pip install -e ".[structured]"') from None
    return llguidance


MAX_CACHED_GRAMMARS = 256


class InvalidGrammar(ValueError):
    """A grammar llguidance refuses; ``reason`` is the library's own message, which says what is wrong."""

    def __init__(self, kind: str, reason: str):
        super().__init__(f"structured_outputs.{kind} is not a grammar llguidance accepts: {reason}")
        self.reason = reason


class GrammarCompiler:
    """Turns a request's ``StructuredOutputsParams`` into a compiled grammar, cached by its text.

    What is cached is a matcher at the grammar's start, never advanced: each request gets a copy.
    Two threads may use one compiler (the server compiles in worker threads, the engine thread
    looks up), so the dict is read and written under a lock, and compiling happens outside it: a
    slow grammar never holds up a lookup. The tokenizer's vocabulary is read once, at the first
    constrained request (about a second for a 49k vocabulary), not at start-up: an engine that
    never sees one never pays it.
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: set[int]):
        self.tokenizer, self.vocab_size, self.stop_token_ids = tokenizer, vocab_size, sorted(stop_token_ids)
        self.grammars: dict[tuple[str, str], object] = {}  # (kind, text) -> matcher at the start: this engine's own
        self._lock = threading.Lock()
        self._vocabulary_lock = threading.Lock()  # read once, by whichever thread asks first
        self._vocabulary = None

    @property
    def _llg_tokenizer(self):
        llguidance = _llguidance()  # the first use says if it is missing
        with self._vocabulary_lock:
            if self._vocabulary is None:
                self._vocabulary = llguidance.hf.from_tokenizer(self.tokenizer, self.vocab_size,
                                                                eos_token=self.stop_token_ids)
            return self._vocabulary

    def _compile(self, kind: str, text: str):
        llguidance, tokenizer = _llguidance(), self._llg_tokenizer
        matcher = llguidance.LLMatcher
        # JSON without free whitespace between its tokens (vLLM's disable_any_whitespace): a model
        # unsure how to go on could otherwise emit blanks until max_tokens.
        compact = {"whitespace_flexible": False}
        try:
            grammar = {"json": lambda: matcher.grammar_from_json_schema(closed_objects(text), defaults=compact),
                       "json_object": lambda: matcher.grammar_from_json_schema('{"type": "object"}', defaults=compact),
                       "regex": lambda: matcher.grammar_from_regex(ascii_classes(text)),
                       "choice": lambda: matcher.grammar_from_regex(_choice_regex(json.loads(text))),
                       "grammar": lambda: matcher.grammar_from_lark(llguidance.gbnf_to_lark.any_to_lark(text))}[kind]()
            error = matcher.validate_grammar(grammar, tokenizer)
        except Exception as e:  # all about the text: the GBNF converter raises bare Exceptions ("Rule 'x' not found")
            error = str(e)
        if error:
            raise InvalidGrammar(kind, error)
        start = matcher(tokenizer, grammar, log_level=0)  # a failure is logged with its request (scheduler.py)
        probe = start.deep_copy()  # a grammar no text matches (`root ::= root "a"`) fails at its first mask
        allowed_tokens([probe], self.vocab_size)
        if probe.is_error():
            raise InvalidGrammar(kind, "no text matches it")
        return start

    def compile(self, params: StructuredOutputsParams):
        """``params``' grammar as a matcher at its start, compiled at the first request that names
        it; an ``InvalidGrammar`` (a ``ValueError``) if the library refuses it. Thread-safe."""
        with self._lock:
            if (start := self.grammars.get(params.key)) is not None:
                return start
        start = self._compile(*params.key)  # outside the lock; two threads may both compile a new text
        with self._lock:
            if len(self.grammars) >= MAX_CACHED_GRAMMARS:  # the oldest goes: a bound on what clients can grow
                self.grammars.pop(next(iter(self.grammars)))
            self.grammars[params.key] = start
        return start

    def matcher(self, params: StructuredOutputsParams):
        """A fresh matcher for ``params``' grammar, at its start: a copy of the cached one."""
        return self.compile(params).deep_copy()


# \d, \w and their complements as vLLM's default backend (xgrammar) and JSON Schema's regexes
# (ECMA-262) read them: ASCII. llguidance's regexes are Rust's, where \d is any Unicode digit, and a
# model asked for \d{3} wrote U+1FBF8 (a segmented-display eight) three times. Inside a class the
# set is spelled out, or nested as a class (Rust's syntax has nested classes).
_ASCII_ESCAPES = {"d": "0-9", "w": "0-9A-Za-z_"}


def ascii_classes(regex: str) -> str:
    """``regex`` with each ``\\d``, ``\\D``, ``\\w`` and ``\\W`` (in a class or not) over ASCII only."""
    out, i, depth = [], 0, 0
    while i < len(regex):
        if regex[i] == "\\" and i + 1 < len(regex):
            escape = regex[i + 1]
            ascii_set = _ASCII_ESCAPES.get(escape.lower())
            if ascii_set is None:
                out.append(regex[i:i + 2])
            elif escape.islower():  # \d, \w
                out.append(ascii_set if depth else f"[{ascii_set}]")
            else:  # \D, \W
                out.append(f"[^{ascii_set}]")
            i += 2
            continue
        if regex[i] == "[":
            depth += 1
            out.append("[")
            i += 1
            for literal in "^]":  # [^ starts a negated class; a ] first in a class is a literal
                if regex.startswith(literal, i):
                    out.append(literal)
                    i += 1
            continue
        if regex[i] == "]" and depth:
            depth -= 1
        out.append(regex[i])
        i += 1
    return "".join(out)


def _choice_regex(choices: list[str]) -> str:
    """A regex whose only matches are ``choices``. One regex is one lexeme, a state machine however
    many choices there are; as a grammar's alternatives (``start: "a" | "b" | ...``) each choice is
    an item of the parser's row, and past 2,000 of them llguidance gave up mid-answer."""
    return "(" + "|".join("".join("\\" + c if c in _REGEX_META else c for c in choice) for choice in choices) + ")"


_REGEX_META = set("\\.+*?()|[]{}^$#&-~")  # what Rust's regex syntax (llguidance's) lets a backslash escape


def closed_objects(schema_text: str) -> str:
    """The JSON schema with ``"additionalProperties": false`` on each object schema that lists its
    properties and says nothing of others, as vLLM's default backend (xgrammar, in strict mode)
    reads a schema and as OpenAI's strict mode requires: a client that calls ``f(**arguments)`` gets
    the arguments it declared, not more. A schema that allows others says so."""
    def close(node):
        if isinstance(node, list):
            return [close(item) for item in node]
        if not isinstance(node, dict):
            return node
        node = {key: close_map(value) if key in _SCHEMA_MAPS else close(value) if key in _SCHEMAS else value
                for key, value in node.items()}
        if isinstance(node.get("properties"), dict) and "additionalProperties" not in node:  # {} too: no property
            node["additionalProperties"] = False
        return node

    def close_map(mapping):  # name -> schema: the names are not schemas
        return {name: close(value) for name, value in mapping.items()} if isinstance(mapping, dict) else mapping
    try:
        return json.dumps(close(json.loads(schema_text)))
    except (ValueError, RecursionError):  # not JSON, or nested past Python's stack: llguidance says what is wrong
        return schema_text


# Where a JSON schema holds the schemas of a value's parts or alternatives: under these keywords,
# and in the values of these maps. Not under allOf, not, if/then/else: there a subschema is one
# condition among others, and closing it would refuse properties another one declares.
_SCHEMAS = {"items", "prefixItems", "additionalItems", "additionalProperties", "anyOf", "oneOf"}
_SCHEMA_MAPS = {"properties", "patternProperties", "$defs", "definitions"}


def allowed_tokens(matchers: list, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """For the rows with a matcher: their indices and their masks of allowed next tokens (bool,
    ``[rows, vocab_size]``, from llguidance's bitmasks, on the CPU); None when no row is constrained."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return None
    llg_torch = _llguidance().torch
    bitmask = llg_torch.allocate_token_bitmask(len(rows), vocab_size)
    for i, row in enumerate(rows):
        llg_torch.fill_next_token_bitmask(matchers[row], bitmask, i)
    bits = (bitmask[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1
    return torch.tensor(rows), bits.flatten(1)[:, :vocab_size].bool()
