"""Input processing: a request's prompt, checked and turned into token ids before anything is queued.

A prompt the engine could never serve is refused here with a ``ValueError`` that says why, before
the tokenizer spends time on it or a step fails on it: text longer than ``max_model_len`` tokens
could hold, a lone surrogate, token ids outside the vocabulary, an empty prompt, one longer than
``max_model_len``. A chat conversation becomes its prompt through the tokenizer's chat template
(vLLM's input preprocessor does both), and a request's ``bad_words`` and ``allowed_token_ids``
become what the logits processors read. The engine's ``tokenize`` and ``chat_prompt`` are these.
"""

import inspect
import numbers

import torch
from jinja2 import TemplateError


class InputProcessor:
    def __init__(self, tokenizer, vocab_size: int, max_model_len: int):
        self.tokenizer, self.vocab_size, self.max_model_len = tokenizer, vocab_size, max_model_len
        # No token covers more characters than the vocabulary's longest (a byte-level token's string
        # has a character per byte), so a text longer than this has more than max_model_len tokens:
        # refused before the tokenizer spends seconds on it (24 MB took 20 s, and memory kept).
        # Without a tokenizer (skip_tokenizer_init) prompts are token ids, and there is no bound to keep.
        self.max_prompt_chars = (max_model_len * max(map(len, tokenizer.get_vocab()))
                                 if tokenizer is not None else None)

    def tokenize(self, prompt: str | list[int] | dict, truncate_prompt_tokens: int | None = None,
                 add_special_tokens: bool = True) -> list[int]:
        """A prompt's token ids, or a ``ValueError`` if the engine could never serve it. A prompt is
        text, token ids, or either in vLLM's dict forms, ``{"prompt": text}`` and
        ``{"prompt_token_ids": ids}``. ``truncate_prompt_tokens`` (``SamplingParams``'): only its
        last tokens are kept. ``add_special_tokens``: a text's, as the tokenizer adds them (BOS)."""
        if isinstance(prompt, dict):
            if len(prompt) != 1 or not prompt.keys() <= {"prompt", "prompt_token_ids"}:
                raise ValueError('a prompt dict holds one key, "prompt" (text) or "prompt_token_ids", '
                                 f"got {sorted(map(str, prompt))}")
            prompt = next(iter(prompt.values()))
        if isinstance(prompt, str) and self.tokenizer is None:
            raise ValueError("prompts must be lists of token ids: the engine has no tokenizer (skip_tokenizer_init=True)")
        if isinstance(prompt, str):
            if truncate_prompt_tokens is not None:
                # Its last tokens are in its end: no token is longer than the vocabulary's longest, so
                # the last max_prompt_chars characters hold at least max_model_len tokens, and in any
                # real text several times that, leaving the cut far from those kept.
                prompt = prompt[-self.max_prompt_chars:]
            self.check_prompt_text(prompt)
            token_ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, numbers.Integral) and not isinstance(t, bool)
                                                      for t in prompt):
            token_ids = [int(t) for t in prompt]  # numpy's integers too, as ints
        else:
            raise ValueError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        # The tokenizer's ids too: one larger than the embedding would otherwise fail the whole step.
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the model's vocabulary [0, {self.vocab_size})")
        if not token_ids:
            raise ValueError("prompt is empty")
        if truncate_prompt_tokens is not None:
            if truncate_prompt_tokens > self.max_model_len:
                raise ValueError(f"truncate_prompt_tokens={truncate_prompt_tokens} is more than max_model_len="
                                 f"{self.max_model_len}")
            token_ids = token_ids[-(self.max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens):]
        if len(token_ids) > self.max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens, more than max_model_len="
                             f"{self.max_model_len}")
        return token_ids

    def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each of ``SamplingParams.bad_words``' token ids as the tokenizer writes it at the start of a
        text and after a space (its spelling inside a text), as vLLM reads them. (vLLM keeps the
        second only where it has as many tokens as the first; both are kept here, so that a word
        one token long after a space, such as " Paris", is banned however the first splits.)"""
        spellings = []
        for word in words:
            alone, spaced = (self.tokenizer.encode(text, add_special_tokens=False)
                             for text in (word.lstrip(), " " + word.lstrip()))
            spellings += [alone] + ([spaced] if spaced != alone else [])
        return spellings

    def allowed_token_mask(self, token_ids: list[int] | None) -> torch.Tensor | None:
        """``SamplingParams.allowed_token_ids`` as a mask over the vocabulary, made once a request: a
        step's rows then share it, where a list of ids would be rebuilt into entries every step
        (with the whole vocabulary allowed in 64 rows, 0.3 s a step)."""
        if token_ids is None:
            return None
        mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        mask[token_ids] = True
        return mask

    def check_prompt_text(self, *texts: str, bounded: bool = True) -> None:
        """A ``ValueError`` for prompt text the tokenizer must not see: more characters than
        ``max_model_len`` tokens can hold (if ``bounded``), or a lone surrogate (which no UTF-8 encodes)."""
        if bounded and (num_chars := sum(map(len, texts))) > self.max_prompt_chars:
            raise ValueError(f"prompt has {num_chars} characters, more than max_model_len={self.max_model_len} "
                             f"tokens could hold ({self.max_prompt_chars} characters)")
        for text in texts:
            try:
                text.encode()
            except UnicodeEncodeError as e:
                raise ValueError(f"prompt is not valid Unicode text: a lone surrogate at character {e.start}") from None

    def chat_prompt(self, conversation: list[dict], chat_template_kwargs: dict | None = None,
                    tools: list[dict] | None = None, add_generation_prompt: bool = True,
                    continue_final_message: bool = False, truncate_prompt_tokens: int | None = None,
                    documents: list[dict] | None = None, chat_template: str | None = None) -> list[int]:
        """A conversation's prompt token ids: the tokenizer's chat template with the generation prompt.

        Tokenized by the template itself, which writes BOS and the like: rendering it to text and
        encoding that with special tokens would put a second BOS in front. ``chat_template_kwargs``
        are the template's own variables, as vLLM passes them (Qwen3's ``enable_thinking``);
        ``tools`` (OpenAI's function tools) the template writes in if it knows how. As in vLLM,
        ``add_generation_prompt=False`` leaves the assistant's header out, and
        ``continue_final_message=True`` leaves the last message open, for the model to go on with
        (an assistant's reply begun by the caller); not both. ``truncate_prompt_tokens`` as ``tokenize``'s;
        ``documents`` (vLLM's) for a template that reads them, as ``tools``; ``chat_template`` (Jinja
        text) in place of the tokenizer's, as vLLM's ``LLM.chat`` takes it.
        """
        check_template_options(add_generation_prompt, continue_final_message)
        if not isinstance(conversation, list) or not conversation or not all(isinstance(m, dict) for m in conversation):
            raise ValueError("a conversation must be a non-empty list of {'role', 'content'} dicts")
        conversation = [{**m, "content": text_of_parts(m["content"])} if isinstance(m.get("content"), list) else m
                        for m in conversation]
        if self.tokenizer is None:
            raise ValueError("chat needs the tokenizer's chat template: the engine has none (skip_tokenizer_init=True)")
        if chat_template is not None and not isinstance(chat_template, str):
            raise ValueError(f"chat_template must be a Jinja template's text, got {type(chat_template).__name__}")
        variables = dict(chat_template_kwargs or {})
        if taken := sorted(variables.keys() & (inspect.signature(self.tokenizer.apply_chat_template).parameters.keys()
                                               | RENDERER_NAMES)):
            raise ValueError(f"chat_template_kwargs may set only the template's variables, not {taken} "
                             "(arguments of apply_chat_template, or names its renderer gives the template)")
        # The template adds more. Cut from its end, a conversation is bounded by the request alone.
        self.check_prompt_text(*(str(m.get("content", "")) for m in conversation),
                               bounded=truncate_prompt_tokens is None)
        try:
            token_ids = self.tokenizer.apply_chat_template(
                conversation, tools=tools, documents=documents, chat_template=chat_template, tokenize=True,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, return_dict=False, **variables)
        # roles out of order, say, a template's syntax, a content it cannot join, or tools nested past the stack
        except (TemplateError, TypeError, RecursionError) as e:
            raise ValueError(f"the chat template rejected the messages: {e}") from e
        return self.tokenize(list(token_ids), truncate_prompt_tokens)


# What transformers' renderer passes a template besides the variables: the conversation, and the two
# functions templates call. A variable by one of these names would fail the render, or the template.
RENDERER_NAMES = {"messages", "raise_exception", "strftime_now"}


def check_template_options(add_generation_prompt: bool, continue_final_message: bool) -> None:
    """A ``ValueError`` for both (vLLM refuses them too): one starts a new message, the other goes on
    with the last."""
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message continues the last message, add_generation_prompt starts a new "
                         "one: set add_generation_prompt=False")


def text_of_parts(parts: list) -> str:
    """OpenAI's content parts (``[{"type": "text", "text": ...}, ...]``) as the one string a chat
    template reads: the texts joined by newlines, as vLLM joins them. Only text parts: this engine
    reads no images or audio."""
    if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in parts):
        raise ValueError("a message's content parts must all be {'type': 'text', 'text': str}; got "
                         f"{[p.get('type') if isinstance(p, dict) else type(p).__name__ for p in parts]}")
    return "\n".join(p["text"] for p in parts)
