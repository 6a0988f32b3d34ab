"""The offline API: ``LLM.generate``, ``LLM.chat``, ``LLM.beam_search`` and ``LLM.embed`` on top of the
engine's loop.

Each call queues its requests (every prompt checked before any is queued), steps the engine until
they are done, and returns dicts (``Output``, whose keys also read as attributes, as vLLM's result
objects' do). An interrupted call (Ctrl-C, an exception) aborts what it queued, so the engine is
left as it was.
"""

from dataclasses import replace

from tqdm.auto import tqdm

from nanoengine.beam_search import BeamSearch
from nanoengine.engine import LLMEngine, interrupts_deferred
from nanoengine.pooler import PoolingParams
from nanoengine.sampling_params import BeamSearchParams, SamplingParams
from nanoengine.sequence import Sequence


class Output(dict):
    """A result: a dict, as nano-vllm returns, whose keys also read as attributes, as vLLM's
    ``RequestOutput`` and ``CompletionOutput`` do, so that both ``out["text"]`` and vLLM's
    ``out.outputs[0].text`` work. (A logprob is a float here, where vLLM's is an object.)"""

    def __getattr__(self, name: str):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"a result has no {name!r}; it has {sorted(self)}") from None


def sample_output(seq: Sequence) -> Output:
    text = seq.detokenizer.text if seq.detokenizer is not None else None  # None: the engine has no tokenizer
    return Output(index=seq.sample_index, text=text, token_ids=seq.completion_token_ids,
                  finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
                  cumulative_logprob=seq.cumulative_logprob, logprobs=seq.logprobs)


def prompt_text(prompt) -> str | None:
    """vLLM's ``RequestOutput.prompt``: the prompt's text, None for one given as token ids."""
    return prompt if isinstance(prompt, str) else prompt.get("prompt") if isinstance(prompt, dict) else None


def _prompt_list(prompts) -> list:
    """One prompt (text or a dict) as a list of one; a list or tuple of prompts as a list."""
    prompts = [prompts] if isinstance(prompts, (str, dict)) else prompts
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a prompt or a non-empty list of them (strings, token-id lists, "
                         "{'prompt': ...} or {'prompt_token_ids': ...})")
    return list(prompts)


class LLM(LLMEngine):
    def get_tokenizer(self):
        """The engine's tokenizer (vLLM's accessor; None with ``skip_tokenizer_init``)."""
        return self.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix, so that the next prompts are computed whole (block_manager.py);
        False, and nothing done, while requests hold KV blocks."""
        return self.block_manager.reset_prefix_cache()

    def generate(self, prompts: str | dict | list[str | list[int] | dict],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[Output]:
        """Complete every prompt (text, token ids, or vLLM's ``{"prompt": ...}`` and
        ``{"prompt_token_ids": ...}``; one alone or a list); results come back in the order of the
        prompts. Without ``sampling_params``, ``SamplingParams()``'s defaults.

        Each result holds its ``n`` samples under "outputs" and, for the first of them, "text",
        "token_ids" and "finish_reason" at the top, as ``n=1`` always did; the prompt's
        "prompt_token_ids" and "prompt_logprobs", and vLLM's "prompt" and "finished";
        every key also reads as an attribute (``Output``).
        """
        prompts = _prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if not isinstance(sampling_params, list):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} sampling_params for {len(prompts)} prompts")
        for params in sampling_params:
            self.check_sampling_params(params)
        # every prompt checked before any is queued
        token_ids = [self.tokenize(p, sp.truncate_prompt_tokens) for p, sp in zip(prompts, sampling_params)]
        results = []
        for prompt, group in zip(prompts, self._run(token_ids, sampling_params, use_tqdm, "Generating")):
            outputs = [sample_output(seq) for seq in group]
            first = group[0]
            results.append(Output(**{k: outputs[0][k] for k in ("text", "token_ids", "finish_reason")},
                                  outputs=outputs, prompt=prompt_text(prompt),
                                  prompt_token_ids=first.token_ids[:first.num_prompt_tokens],
                                  prompt_logprobs=first.prompt_logprobs, finished=True))
        return results

    def embed(self, prompts: str | dict | list[str | list[int] | dict], *, truncate_prompt_tokens: int | None = None,
              use_tqdm: bool = True, pooling_params: PoolingParams | list[PoolingParams] | None = None) -> list[Output]:
        """vLLM's: each prompt's vector, pooled from its hidden states as the model says (pooler.py),
        in the order of the prompts; needs ``LLM(model, runner="pooling")``. Each result holds the
        "embedding" (a list of floats, also as vLLM's ``outputs.embedding``) and "prompt_token_ids".
        ``pooling_params``' ``dimensions`` truncates a Matryoshka model's vectors; ``truncate_prompt_tokens``
        (or ``pooling_params``') keeps each prompt's last tokens."""
        prompts = _prompt_list(prompts)
        if not isinstance(pooling_params, list):
            pooling_params = [pooling_params or PoolingParams()] * len(prompts)
        if len(pooling_params) != len(prompts):
            raise ValueError(f"got {len(pooling_params)} pooling_params for {len(prompts)} prompts")
        for p in pooling_params:
            self.check_pooling_params(p)
        params = pooling_params if truncate_prompt_tokens is None else [
            replace(p, truncate_prompt_tokens=truncate_prompt_tokens) for p in pooling_params]
        token_ids = [self.tokenize(prompt, p.truncate_prompt_tokens) for prompt, p in zip(prompts, params)]
        results = []
        for prompt, (seq,) in zip(prompts, self._run(token_ids, params, use_tqdm, "Embedding")):
            embedding = seq.pooled.tolist()
            results.append(Output(embedding=embedding, outputs=Output(embedding=embedding), prompt=prompt_text(prompt),
                                  prompt_token_ids=seq.token_ids, finished=True))
        return results

    def _run(self, token_ids: list[list[int]], params: list[SamplingParams] | list[PoolingParams], use_tqdm: bool,
             desc: str) -> list[list[Sequence]]:
        """Queue a request per prompt (checked already) and step until all are done; each request's
        sequences (its group). Whatever happens, nothing is left queued."""
        request_ids, bar = [], tqdm(total=len(token_ids), desc=desc, dynamic_ncols=True, disable=not use_tqdm)
        try:
            for t, p in zip(token_ids, params):
                request_ids.append(self.add_request(t, p))
            groups = [self.requests[i].group for i in request_ids]
            while any(not seq.is_finished for group in groups for seq in group):
                self.step()
                c = self.counters
                bar.set_postfix_str(f"prefill {c['prefill_tokens'] / max(c['prefill_seconds'], 1e-9):.0f} tok/s, "
                                    f"decode {c['decode_tokens'] / max(c['decode_seconds'], 1e-9):.0f} tok/s",
                                    refresh=False)
                bar.update(sum(all(seq.is_finished for seq in group) for group in groups) - bar.n)
        finally:
            bar.close()
            with interrupts_deferred():
                for request_id in request_ids:  # an interrupted or failed call leaves nothing queued behind
                    self.abort_request(request_id)
        return groups

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None, use_tqdm: bool = True,
             chat_template_kwargs: dict | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict] | None = None,
             chat_template: str | None = None) -> list[Output]:
        """``generate`` on one conversation (a list of ``{"role", "content"}``) or a list of them,
        each rendered by the tokenizer's chat template (or ``chat_template``, a Jinja template's text)
        with the generation prompt (and the template's variables in ``chat_template_kwargs``, e.g.
        ``{"enable_thinking": False}``; vLLM's ``add_generation_prompt``, ``continue_final_message``
        and ``tools``, as ``LLMEngine.chat_prompt`` takes them)."""
        conversations = [messages] if isinstance(messages, list) and messages and isinstance(messages[0], dict) \
            else messages
        if not isinstance(conversations, list) or not conversations:
            raise ValueError("messages must be a conversation (a list of {'role', 'content'} dicts) or a list of them")
        options = dict(add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                       chat_template=chat_template)
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(conversations)
        if len(params) != len(conversations):
            raise ValueError(f"got {len(params)} sampling_params for {len(conversations)} conversations")
        results = self.generate([self.chat_prompt(c, chat_template_kwargs, tools, **options,
                                                  truncate_prompt_tokens=getattr(p, "truncate_prompt_tokens", None))
                                 for c, p in zip(conversations, params)], sampling_params, use_tqdm)
        for result in results:  # vLLM's prompt of a chat: the text the template rendered
            result["prompt"] = self.tokenizer.decode(result["prompt_token_ids"])
        return results

    def beam_search(self, prompts: str | dict | list[str | list[int] | dict], params: BeamSearchParams) -> list[Output]:
        """The ``beam_width`` best completions of each prompt, best first (see beam_search.py)."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        prompts = _prompt_list(prompts)
        token_ids = [self.tokenize(p) for p in prompts]
        if (longest := max(map(len, token_ids))) + params.max_tokens - 1 > self.config.max_model_len:
            raise ValueError(f"max_tokens={params.max_tokens} after a prompt of {longest} tokens exceeds "
                             f"max_model_len={self.config.max_model_len}")
        searches = [BeamSearch(params, self.scheduler.eos_token_ids) for _ in prompts]
        if (num_candidates := searches[0].num_candidates) > self.config.max_logprobs:  # each step's logprobs
            raise ValueError(f"beam_width={params.beam_width} needs the logprobs of {num_candidates} candidates a "
                             f"step, more than max_logprobs={self.config.max_logprobs}")
        while live := [(search, prompt) for search, prompt in zip(searches, token_ids) if not search.done]:
            # Each live beam asks for one token and the logprobs of its best candidates.
            step = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logprobs=live[0][0].num_candidates)
            beams = [prompt + beam.token_ids for search, prompt in live for beam in search.running]
            outputs = iter(self.generate(beams, step, use_tqdm=False))
            for search, _ in live:
                search.step([next(outputs)["outputs"][0]["logprobs"][0] for _ in search.running])

        def text(search: BeamSearch, token_ids: list[int]) -> str | None:
            """A beam's text: the EOS that ended it left out unless included, as a sample's stop token is."""
            if self.tokenizer is None:  # token ids only
                return None
            eos = token_ids[-1:] if token_ids[-1] in search.eos_token_ids else []
            text = self.tokenizer.decode(token_ids[:len(token_ids) - len(eos)], skip_special_tokens=True)
            return text + self.tokenizer.decode(eos) if params.include_stop_str_in_output else text
        # vLLM's names too: a beam's ``tokens`` begin with the prompt's, its ``cum_logprob`` is ours
        return [Output(sequences=[Output(text=text(search, beam.token_ids), token_ids=beam.token_ids,
                                         cumulative_logprob=beam.cumulative_logprob, tokens=prompt + beam.token_ids,
                                         cum_logprob=beam.cumulative_logprob) for beam in search.best()])
                for search, prompt in zip(searches, token_ids)]
