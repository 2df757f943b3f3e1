"""Several streams on one model at once, as an agent would run them (asyncio.gather).

Their steps share the target: each step of the model runs every stream's tokens in one forward,
and each answer is exactly what the stream would give alone.
"""

import asyncio

import dflash2
from dflash2.demo_model import smollm2_gguf

QUESTIONS = ["What is 2 + 2?", "Name a primary colour.", "What is the opposite of hot?"]


async def ask(model: dflash2.Model, question: str) -> dflash2.Completion:
    return await model.agenerate([{"role": "user", "content": question}], max_new_tokens=24)


async def main() -> None:
    model = dflash2.load(smollm2_gguf())
    answers = await asyncio.gather(*(ask(model, q) for q in QUESTIONS))
    for question, answer in zip(QUESTIONS, answers, strict=True):
        stats = answer.stats
        print(f"Q: {question}\nA: {answer.text.strip()}")
        print(f"   ({stats.steps} steps, each shared by {stats.mean_batch_size:.1f} streams on average)\n")


asyncio.run(main())
