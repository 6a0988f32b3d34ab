"""The scenes of ``python example.py --trace`` and docs/walkthrough.md: small runs of the default
model (greedy, but for the fork's seeded samples), each built so that one mechanism happens where a
``StepObserver`` (trace.py) prints it.

Each scene has its engine's options (``SCENE_OPTIONS``) and its requests (``demo``); the printed
steps are the observer's.
"""

from typing import Callable

from nanoengine.llm import LLM
from nanoengine.sampling_params import SamplingParams, StructuredOutputsParams
from nanoengine.trace import StepObserver

# The scenes' engines: blocks of 8 tokens. "preemption": a cache of 8 blocks, small enough that the
# third request is preempted; "chunked": a step budget of 24 tokens, so prompts arrive in chunks
# beside running decodes; "fork": one request with n=2 whose samples share their prompt's blocks;
# "speculative": n-gram drafts of up to 6 tokens, verified a step at a time; "structured": one
# request whose output must follow a JSON schema; "graphs": decode steps whose batch shrinks and
# grows, through CPU graphs (on by default: neither enforce_eager nor learner_mode); "sliding": SmolLM2
# read as a Mistral whose every layer sees 16 tokens (hf_overrides: same weights, a window they were
# not trained with), prompts in chunks of 16, so that blocks fall out of the window and go back.
DEMO_OPTIONS = dict(dtype="float32", device="cpu", kvcache_block_size=8, num_kvcache_blocks=8)
SCENE_OPTIONS = {"preemption": DEMO_OPTIONS,
                 "chunked": {**DEMO_OPTIONS, "num_kvcache_blocks": 24, "enable_chunked_prefill": True,
                             "max_num_batched_tokens": 24},
                 "fork": {**DEMO_OPTIONS, "num_kvcache_blocks": 24},
                 "speculative": {**DEMO_OPTIONS, "num_kvcache_blocks": 24, "speculative_config": {
                     "method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_max": 3, "prompt_lookup_min": 2}},
                 "structured": {**DEMO_OPTIONS, "num_kvcache_blocks": 24},
                 "graphs": {**DEMO_OPTIONS, "num_kvcache_blocks": 24},
                 "sliding": {**DEMO_OPTIONS, "num_kvcache_blocks": 24, "enable_chunked_prefill": True,
                             "max_num_batched_tokens": 16,
                             "hf_overrides": {"model_type": "mistral", "sliding_window": 16}}}
DEMO_SYSTEM = "You are a concise assistant. Answer in one sentence."
DEMO_QUESTIONS = ["What is the capital of France?", "What is the capital of Italy?", "Name a primary color."]
# The sentence's own words are the n-gram drafts; the model's answer leaves them once ("climbed").
DEMO_REWRITE = "Rewrite in the past tense: The old lighthouse keeper climbs the stairs every evening at dusk."
DEMO_REPEAT = "Repeat this sentence: The old lighthouse keeper climbed the stairs every evening at dusk."
# Bounded strings, so that any model's output closes within a few dozen tokens.
DEMO_SCHEMA = {"type": "object", "required": ["city", "country"], "properties": {
    "city": {"type": "string", "maxLength": 16}, "country": {"enum": ["France", "Italy", "Spain"]}}}


def demo(llm: LLM, write: Callable[[str], None] = print, max_tokens: int = 24,
         scene: str = "preemption") -> StepObserver:
    """Play a scene (greedy; the engine made with ``LLM(**SCENE_OPTIONS[scene])``):

    - "preemption": two chat requests that share a system prompt, a third arriving after the first
      step; the 8-block cache forces one preemption.
    - "chunked": the same three requests under chunked prefill with 24 tokens a step: prompts are
      computed in chunks, in steps that also decode the running sequences.
    - "fork": one request with ``n=2`` (sampled, seeded): its two samples share the prompt's blocks,
      and the shared, partly filled last block is copied on write.
    - "speculative": one request to rewrite a sentence, with n-gram drafts: each step computes the
      newest token and the drafts after it, keeps what the model agrees with, takes back the rest,
      and the sequence goes on.
    - "structured": one request whose answer must follow ``DEMO_SCHEMA``: at each step its grammar
      allows some tokens, the sampler takes one of them, the matcher moves past it.
    - "graphs": three requests that stop after ``max_tokens`` / 8, / 4 and * 3 / 8 tokens, and a
      fourth arriving once one is left: the decode batch goes 3, 2, 1, then 2 and 1 again, and each
      batch-size bucket's first step records its graph, every later one replays it.
    - "sliding": one chat request on a model whose every layer slides: its prompt's chunks take their
      blocks as they run, and the blocks behind the window are released as the sequence goes on.
    """
    observer = StepObserver(llm, write, graphs=scene == "graphs")
    chats = [llm.chat_prompt([{"role": "system", "content": DEMO_SYSTEM}, {"role": "user", "content": q}])
             for q in DEMO_QUESTIONS]
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens)
    # (how many steps have run when it arrives, prompt, params)
    requests = [(0, chats[0], greedy), (0, chats[1], greedy), (1, chats[2], greedy)]
    if scene == "fork":
        # The third question: 30 tokens, so the prompt ends inside a block, which both samples then write.
        requests = [(0, chats[2], SamplingParams(n=2, temperature=1.0, seed=0, max_tokens=max_tokens // 3))]
    elif scene == "speculative":
        requests = [(0, llm.chat_prompt([{"role": "user", "content": DEMO_REWRITE}]), greedy)]
    elif scene == "sliding":  # a window of 16: copying a sentence needs only the last few tokens
        requests = [(0, llm.chat_prompt([{"role": "user", "content": DEMO_REPEAT}]), greedy)]
    elif scene == "structured":
        requests = [(0, llm.chat_prompt([{"role": "user", "content": DEMO_QUESTIONS[0] + " Answer in JSON."}]),
                     SamplingParams(temperature=0, max_tokens=max_tokens,
                                    structured_outputs=StructuredOutputsParams(json=DEMO_SCHEMA)))]
    elif scene == "graphs":  # each stops at its own length (ignore_eos), so the batch shrinks as planned
        def stop_after(n: int) -> SamplingParams:
            return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        requests = [(0, chat, stop_after(max_tokens * k // 8)) for chat, k in zip(chats, (1, 2, 3))]
        requests.append((max_tokens // 4 + 1, chats[0], stop_after(max_tokens // 4)))  # once one is left
    steps = 0
    while requests or llm.has_unfinished_requests():
        for request in [r for r in requests if r[0] == steps]:
            llm.add_request(*request[1:])
            requests.remove(request)
        llm.step()
        steps += 1
    return observer
