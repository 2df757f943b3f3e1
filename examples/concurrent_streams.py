"""Several streams on one model at once, as an agent would run them (asyncio.gather)."""

import asyncio

import dflash2
from dflash2.demo_model import smollm2_gguf

QUESTIONS = ["What is 2 + 2?", "Name a primary colour.", "What is the opposite of hot?"]


async def ask(model: dflash2.Model, question: str) -> str:
    completion = await model.agenerate([{"role": "user", "content": question}], max_new_tokens=24)
    return completion.text


async def main() -> None:
    model = dflash2.load(smollm2_gguf())
    answers = await asyncio.gather(*(ask(model, q) for q in QUESTIONS))
    for question, answer in zip(QUESTIONS, answers, strict=True):
        print(f"Q: {question}\nA: {answer.strip()}\n")


asyncio.run(main())
