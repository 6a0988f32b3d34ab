"""Incremental detokenization: a completion's token ids become text as they arrive.

Every sequence carries one (the engine makes it): ``Scheduler.postprocess`` feeds it each new
token, and a stop string found in the text finishes the sequence, the same way offline and in
the server, which streams what each step's tokens added (``last_deltas``). Re-decoding the whole completion for every
token would cost time that grows with the completion (quadratic in all); here each token costs
the same however long the text already is.
"""

from tokenizers.decoders import DecodeStream


class Detokenizer:
    """A completion's text as its tokens arrive; ``add`` returns only text that is final.

    New tokens are decoded together with a few before them (vLLM's prefix and read offsets):
    the text of ``ids[prefix_offset:]`` past that of ``ids[prefix_offset:read_offset]`` is new,
    since a tokenizer may decode a token differently at the start of a text. While that text
    ends in U+FFFD (half a character: one character may span several tokens) it waits for the
    next token. A fast tokenizer does the same in Rust (the ``tokenizers`` library's
    ``DecodeStream``, as vLLM does); the offsets here are then kept only for a half character
    left at the end, which is returned as U+FFFD, as ``decode`` gives it.

    The last ``len(longest stop string) - 1`` characters also wait, in case they begin a stop
    string; the text is cut before the first match (after it, with ``include_stop``). A match ends
    in the new text, so only the new text and those held-back characters are searched; and, as in
    vLLM, it ends in the text of a token past the first ``min_tokens``.
    """

    def __init__(self, tokenizer, stop: list[str], include_stop: bool = False, skip_special_tokens: bool = True,
                 min_tokens: int = 0):
        self.tokenizer, self.stop, self.include_stop = tokenizer, stop, include_stop
        self.skip_special_tokens, self.min_tokens = skip_special_tokens, min_tokens
        self.holdback = max(map(len, stop), default=1) - 1
        # DecodeStream skips cleanup_tokenization_spaces, which decode would apply.
        fast = hasattr(tokenizer, "backend_tokenizer") and not getattr(tokenizer, "clean_up_tokenization_spaces", False)
        self.decode_stream = DecodeStream(skip_special_tokens=skip_special_tokens) if fast else None
        self.token_ids: list[int] = []
        self.prefix_offset = self.read_offset = 0
        self.sent: list[str] = []  # what add has returned
        self.held = ""  # final text not returned yet: the stop-string holdback
        self.stopped = False
        self.stop_string: str | None = None  # the stop string that ended the text

    @property
    def text(self) -> str:
        return "".join(self.sent) + self.held

    def last_deltas(self, num_adds: int) -> str:
        """What the latest ``num_adds`` calls of ``add`` returned: the text a step's tokens made final
        (one add per token; a step appends more than one with speculative drafts)."""
        return "".join(self.sent[len(self.sent) - num_adds:])

    def fork(self) -> "Detokenizer":
        """A detokenizer for a sequence forked from this one before its first token."""
        assert not self.token_ids
        return Detokenizer(self.tokenizer, self.stop, self.include_stop, self.skip_special_tokens, self.min_tokens)

    def add(self, token_ids: list[int], finished: bool) -> str:
        """The text that a sampled token (``token_ids``: it, or none for a stop token left out of
        the text) makes final; one call per sampled token."""
        self.token_ids += token_ids
        text = self.held + self.detokenize(token_ids, finished)
        # (start, end) of each stop string's first match that ends in the new text; the earliest
        # start ends the text
        matches = []
        if len(self.token_ids) > self.min_tokens:
            found = ((s, text.find(s, max(0, len(self.held) - len(s) + 1))) for s in self.stop)
            matches = [(i, i + len(s), s) for s, i in found if i >= 0]
        if matches:
            start, end, self.stop_string = min(matches)
            text, self.stopped = text[:end if self.include_stop else start], True
        end = len(text) if self.stopped or finished else max(0, len(text) - self.holdback)
        delta, self.held = text[:end], text[end:]
        self.sent.append(delta)
        return delta

    def detokenize(self, token_ids: list[int], finished: bool) -> str:
        """The text that ``token_ids`` complete; once ``finished``, all that is left."""
        if self.decode_stream is None:
            return self.decode_window(finished)
        text = self.decode_stream.step(self.tokenizer.backend_tokenizer, token_ids) if token_ids else None
        if text is not None:
            self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return (text or "") + (self.decode_window(True) if finished else "")

    def decode_window(self, finished: bool) -> str:
        ids = self.token_ids
        if self.read_offset == len(ids):
            return ""
        skip = self.skip_special_tokens
        prefix = self.tokenizer.decode(ids[self.prefix_offset:self.read_offset], skip_special_tokens=skip)
        text = self.tokenizer.decode(ids[self.prefix_offset:], skip_special_tokens=skip)
        if len(text) <= len(prefix) or (text.endswith("\ufffd") and not finished):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(ids)
        return text[len(prefix):]
