"""Input processing: a request, checked and turned into the sequence the scheduler queues.

A prompt the engine could never serve is refused here with a ``ValueError`` that says why, before
the tokenizer spends time on it or a step fails on it: text longer than ``max_model_len`` tokens
could hold, a lone surrogate, token ids outside the vocabulary, an empty prompt, one longer than
``max_model_len``. A chat conversation becomes its prompt through the tokenizer's chat template
(vLLM's input preprocessor does both), and a request's ``bad_words`` and ``allowed_token_ids``
become what the logits processors read. Sampling and pooling parameters are checked against
what this engine was built with (its vocabulary, its limits, its runner) in the same pass. The
engine's ``tokenize``, ``chat_prompt`` and ``add_request`` start here.
"""

import inspect
import numbers

import torch
from jinja2 import TemplateError

from nanoengine.config import Config
from nanoengine.detokenizer import Detokenizer
from nanoengine.pooler import Pooler, PoolingParams
from nanoengine.sampling_params import SamplingParams
from nanoengine.sequence import Sequence
from nanoengine.structured_output import GrammarCompiler


class InputProcessor:
    def __init__(self, tokenizer, vocab_size: int, config: Config, eos_token_ids: set[int],
                 grammars: GrammarCompiler, pooler: Pooler | None):
        self.tokenizer, self.vocab_size, self.config = tokenizer, vocab_size, config
        self.max_model_len = max_model_len = config.max_model_len
        self.eos_token_ids, self.grammars, self.pooler = eos_token_ids, grammars, pooler
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

    def process(self, prompt, params: SamplingParams | PoolingParams, block_size: int) -> Sequence:
        """A request as the sequence the scheduler queues, checked first: its prompt tokenized, and what
        its sampling reads made once (the detokenizer, a grammar's matcher, bad words, allowed tokens).
        A pooling request's prompt is scheduled like any other; its last step pools instead of
        sampling (pooler.py), and its SamplingParams are the defaults, which read nothing."""
        if isinstance(params, PoolingParams):
            self.check_pooling_params(params)
            seq = Sequence(self.tokenize(prompt, params.truncate_prompt_tokens), SamplingParams(), block_size)
            seq.pooling_params = params
            return seq
        self.check_sampling_params(params)
        seq = Sequence(self.tokenize(prompt, params.truncate_prompt_tokens), params, block_size)
        if self.tokenizer is not None:  # without one, outputs are token ids and their text is None
            seq.detokenizer = Detokenizer(self.tokenizer, params.stop, params.include_stop_str_in_output,
                                          params.skip_special_tokens, params.min_tokens)
        if params.structured_outputs is not None:
            seq.grammar = self.grammars.matcher(params.structured_outputs)
        seq.bad_words_token_ids = self.bad_words_token_ids(params.bad_words)
        seq.allowed_token_mask = self.allowed_token_mask(params.allowed_token_ids)
        return seq

    def check_sampling_params(self, sampling_params: SamplingParams) -> None:
        """A ``ValueError`` for parameters this engine could never serve."""
        if not isinstance(sampling_params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}")
        if self.config.runner == "pooling":
            raise ValueError("this engine's runner is 'pooling': it embeds prompts (LLM.embed, /v1/embeddings) and "
                             "generates nothing; start one with runner='generate' (the default) to generate")
        sampling_params.check()  # a field set after it was made (``sp.max_tokens = None``)
        if sampling_params.n > self.config.max_num_seqs:  # a request's samples run side by side
            raise ValueError(f"n={sampling_params.n} is more than max_num_seqs={self.config.max_num_seqs}")
        if sampling_params.stop and self.tokenizer is None:  # stop strings are found in the text
            raise ValueError("stop strings need text: the engine has no tokenizer (skip_tokenizer_init=True); "
                             "use stop_token_ids")
        if sampling_params.bad_words and self.tokenizer is None:
            raise ValueError("bad_words need the tokenizer: the engine has none (skip_tokenizer_init=True)")
        for field in ("logit_bias", "stop_token_ids", "allowed_token_ids"):  # token ids the logits are indexed by
            if bad := [t for t in getattr(sampling_params, field) or () if not 0 <= t < self.vocab_size]:
                raise ValueError(f"{field} names token ids {bad[:5]} outside the model's vocabulary "
                                 f"[0, {self.vocab_size})")
        config = self.config
        for field in ("logprobs", "prompt_logprobs"):
            if (value := getattr(sampling_params, field)) is not None and value > config.max_logprobs:
                raise ValueError(f"{field}={value} is more than max_logprobs={config.max_logprobs}")
            if value is not None and value > self.vocab_size:  # whatever max_logprobs allows: topk would fail the step
                raise ValueError(f"{field}={value} is more than the vocabulary's {self.vocab_size} tokens")
        # bad_words are checked against every step's tokens as stop strings are against its text
        for field in ("stop", "bad_words"):
            strings = getattr(sampling_params, field)
            if len(strings) > config.max_stop_strings:
                raise ValueError(f"{field} has {len(strings)} strings, more than "
                                 f"max_stop_strings={config.max_stop_strings}")
            if (longest := max(map(len, strings), default=0)) > config.max_stop_string_length:
                raise ValueError(f"{field} has a string of {longest} characters, more than "
                                 f"max_stop_string_length={config.max_stop_string_length}")
        # A row of -inf samples nonsense: refused where it is certain from the start (the few one-token
        # bad words can ban all of a row's allowed tokens, never the whole vocabulary).
        params, why = sampling_params, "each is a one-token bad word, or a stop token that min_tokens holds back"
        banned = ((set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids))
                  if params.min_tokens else set())
        if (allowed := params.allowed_token_ids) is not None:
            banned |= {w[0] for w in self.bad_words_token_ids(params.bad_words) if len(w) == 1}
            if set(allowed) <= banned:
                raise ValueError(f"allowed_token_ids leaves no token to sample: {why}")
        elif len(banned) >= self.vocab_size:
            raise ValueError(f"stop_token_ids leaves no token to sample: {why}")
        if sampling_params.structured_outputs is not None:
            if self.tokenizer is None:
                raise ValueError("structured_outputs needs the tokenizer: the engine has none (skip_tokenizer_init=True)")
            self.grammars.compile(sampling_params.structured_outputs)  # a bad grammar is refused before queuing

    def check_pooling_params(self, pooling_params: PoolingParams) -> None:
        """A ``ValueError`` for a pooling request this engine could never serve."""
        if not isinstance(pooling_params, PoolingParams):
            raise ValueError(f"pooling_params must be a PoolingParams, got {type(pooling_params).__name__}")
        if self.config.runner != "pooling":
            raise ValueError("embedding needs a pooling runner: LLM(model, runner='pooling') "
                             "(python -m nanoengine.serve --runner pooling)")
        self.pooler.check(pooling_params)

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
