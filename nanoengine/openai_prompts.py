"""What the completions API does with its prompts besides completing them: a batch of prompts in
any of OpenAI's four forms, each prompt echoed in front of its choices (``echo``), and the prompt
tokens' logprobs in vLLM's ``prompt_logprobs`` shape.

Scoring a text is how evaluation harnesses (lm-evaluation-harness) compute loglikelihoods and
perplexity through the API: ``echo`` with ``logprobs`` and ``max_tokens`` 0 or 1 returns every
prompt token's logprob, the first one null (nothing before it predicts it). serve.py calls these;
the numbers are the engine's ``prompt_logprobs``, as offline.
"""

import asyncio
from dataclasses import replace
from itertools import islice

from nanoengine.serve_async_engine import AsyncLLMEngine, RequestOutput
from nanoengine.openai_protocol import BadRequest

Prompt = str | list[int]


def prompt_batch(prompt: str | list[str] | list[int] | list[list[int]]) -> list[Prompt]:
    """The prompts of a completions request: a string or a list of token ids is one prompt, a list
    of either is a batch (pydantic has already refused any other shape)."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    if not prompt:
        raise BadRequest("prompt: must not be an empty list", "prompt")
    return prompt


async def tokenize_batch(engine: AsyncLLMEngine, prompts: list[Prompt], truncate_prompt_tokens: int | None = None,
                         add_special_tokens: bool = True) -> list[list[int]]:
    """Every prompt's token ids (its last ``truncate_prompt_tokens``), each checked as a single prompt
    is (not empty, within the vocabulary and ``max_model_len``), all before any is queued; in a worker
    thread, as tokenizing may be long."""
    def tokenize(index: int, prompt: Prompt) -> list[int]:
        try:
            return engine.tokenize(prompt, truncate_prompt_tokens, add_special_tokens)
        except ValueError as e:  # the engine's messages start "prompt ...": a batch's say which
            raise BadRequest(f"prompt[{index}]: {e}" if len(prompts) > 1 else str(e), "prompt") from None
    return await asyncio.to_thread(lambda: [tokenize(i, p) for i, p in enumerate(prompts)])


class Echo:
    """Puts each prompt in front of its choices: a choice's first output gets the prompt's text and,
    when the request asked for logprobs, an entry per prompt token (``{token_id: None}`` for the
    first, then the token's logprob and the ``num_logprobs`` most likely, as a sampled token's).

    ``max_tokens: 0`` (score the prompt, generate nothing) runs as ``max_tokens: 1`` and drops
    that token (``drop_sample``), as vLLM does: the prefill that computes the prompt's logprobs
    samples a token from its last position anyway, so this costs no extra step, and the engine
    keeps its rule that every request samples.

    Chat's ``echo`` (vLLM's) is the same with the last message's text as the prompt and no
    logprobs for it (``num_logprobs`` None): a reply that goes on with that message then reads whole.
    """

    def __init__(self, tokenizer, prompts: list[Prompt], token_ids: list[list[int]], n: int,
                 num_logprobs: int | None, drop_sample: bool):
        # A prompt given as text is echoed as given; one given as token ids, as they decode.
        self.texts = [p if isinstance(p, str) else tokenizer.decode(p) for p in prompts]
        self.first_token_ids = [ids[0] for ids in token_ids]
        self.n, self.num_logprobs, self.drop_sample = n, num_logprobs, drop_sample
        self.started: set[int] = set()  # the choices whose first output has gone by

    def __call__(self, out: RequestOutput) -> RequestOutput:
        if self.drop_sample:
            out = replace(out, token_ids=[], text="", logprobs=None if out.logprobs is None else [],
                          finish_reason="length")
        if out.index in self.started:
            return out
        self.started.add(out.index)
        prompt = out.index // self.n
        logprobs = out.logprobs
        if logprobs is not None and self.num_logprobs is not None:  # the token, then its num_logprobs most likely
            scored = [dict(islice(top.items(), self.num_logprobs + 1)) for top in out.prompt_logprobs[1:]]
            logprobs = [{self.first_token_ids[prompt]: None}] + scored + logprobs
        return replace(out, text=self.texts[prompt] + out.text, logprobs=logprobs)


def vllm_prompt_logprobs(tokenizer, prompt_logprobs: list[dict[int, float] | None], num_top: int) -> list:
    """vLLM's ``prompt_logprobs``: per prompt token (None for the first) ``{token_id: {"logprob",
    "rank", "decoded_token"}}`` with the token's entry and its ``num_top`` most likely ones.

    Ranks count from 1 in the model's distribution. The engine returns the top tokens in order,
    so their ranks are known; the prompt token's own rank is known only when it is one of them,
    and is null otherwise.
    """
    def entries(top: dict[int, float]) -> dict:
        token, ranked = next(iter(top)), sorted(top, key=top.get, reverse=True)
        in_top = len(top) <= num_top  # the token came back among the top ones, not beside them
        return {t: {"logprob": top[t], "rank": ranked.index(t) + 1 if t != token or in_top else None,
                    "decoded_token": tokenizer.decode([t])} for t in top}
    return [None if top is None else entries(top) for top in prompt_logprobs]
