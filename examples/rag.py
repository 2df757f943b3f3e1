"""Retrieval-augmented generation with a drafter that drafts from the retrieved text.

A few local documents are ranked against the question (plain word overlap, no embedding model
needed), the best two go into the prompt, and the answer is generated with the hybrid drafter:
prompt lookup drafts the spans the answer copies from the documents, the shipped DFlash drafter
the rest. The answer is exactly what plain decoding gives; the script prints both speeds.

Run: python examples/rag.py   (offline, SmolLM2-135M-Instruct)
"""

import os
import re
from collections import Counter

import dflash2
from dflash2.demo_model import shipped_drafter, smollm2_gguf

MAX_NEW_TOKENS = int(os.environ.get("DFLASH2_EXAMPLE_TOKENS", "96"))

DOCUMENTS = {
    "kv-cache.md": (
        "The KV cache stores the keys and values of every token the model has processed. "
        "dflash2 keeps one static cache per stream; rejecting a draft only moves the cache length back, "
        "so a rollback costs nothing."
    ),
    "drafters.md": (
        "dflash2 has three kinds of drafters. The n-gram drafter copies the continuation of the latest "
        "match in the prompt, which is ideal for retrieval-augmented generation and code editing. The DFlash "
        "drafter drafts a whole block in one forward pass. The hybrid drafter tries the lookup first and "
        "the DFlash drafter otherwise."
    ),
    "sampling.md": (
        "With temperature 0 the output is the target's greedy text. With sampling, rejection sampling keeps "
        "the target's distribution, and a seed makes a stream reproducible whatever runs beside it."
    ),
    "serving.md": (
        "dflash2 serve starts an OpenAI-compatible server on 127.0.0.1. At larger scale, export the drafter "
        "and serve it with SGLang or vLLM."
    ),
}
QUESTION = "Which dflash2 drafter should I use for retrieval-augmented generation, and why?"


def words(text: str) -> Counter[str]:
    return Counter(re.findall(r"[a-z0-9-]+", text.lower()))


def retrieve(question: str, k: int = 2) -> list[str]:
    """The ``k`` documents sharing the most words with the question."""
    asked = words(question)
    scores = {name: sum(min(n, asked[w]) for w, n in words(text).items()) for name, text in DOCUMENTS.items()}
    return sorted(scores, key=lambda name: -scores[name])[:k]


def main() -> None:
    chosen = retrieve(QUESTION)
    print("retrieved:", ", ".join(chosen))
    context = "\n\n".join(f"[{name}]\n{DOCUMENTS[name]}" for name in chosen)
    messages = [
        {"role": "system", "content": "Answer from the documents, quoting them where you can."},
        {"role": "user", "content": f"{context}\n\nQuestion: {QUESTION}"},
    ]
    plain = dflash2.load(smollm2_gguf(), prefix_cache=0)  # both runs prefill the prompt, for a fair comparison
    drafter = shipped_drafter()
    hybrid = plain.with_drafter(["ngram", drafter] if drafter else "ngram")
    for model in (plain, hybrid):  # warm-up
        model.generate(messages, max_new_tokens=8)
    base = plain.generate(messages, max_new_tokens=MAX_NEW_TOKENS)
    fast = hybrid.generate(messages, max_new_tokens=MAX_NEW_TOKENS)
    print(f"answer: {fast.text.strip()}")
    print(f"plain decoding: {base.stats.tokens_per_second:.1f} tokens/s")
    print(
        f"hybrid drafter: {fast.stats.tokens_per_second:.1f} tokens/s, "
        f"{fast.stats.mean_acceptance_length:.2f} tokens per target forward"
    )
    speedup = fast.stats.tokens_per_second / max(base.stats.tokens_per_second, 1e-9)
    same = "identical" if fast.token_ids == base.token_ids else "DIFFERENT (please report a bug)"
    print(f"speedup {speedup:.2f}x, outputs {same}")


if __name__ == "__main__":
    main()
