"""An asyncio agent loop on one model: sub-tasks run as concurrent streams, a tool call is parsed
from the model's output and its result fed back, and a stream is cancelled once its answer is no
longer needed. All streams of the model share its target forwards.

Run: python examples/agent.py   (offline, SmolLM2-135M-Instruct with the shipped drafter)
"""

import ast
import asyncio
import operator
import os
import re

import dflash2
from dflash2.demo_model import shipped_drafter, smollm2_gguf

MAX_NEW_TOKENS = int(os.environ.get("DFLASH2_EXAMPLE_TOKENS", "48"))
TOOL_CALL = re.compile(r"calculator\(([0-9+\-*/ .()]+)\)")
SYSTEM = "You have a calculator. To use it, reply with calculator(<arithmetic expression>) and nothing else."
OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def calculator(expression: str) -> float:
    """The tool: + - * / on numbers, nothing else (never ``eval``)."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.left), value(node.right))
        raise ValueError(f"not arithmetic: {expression!r}")

    return value(ast.parse(expression, mode="eval").body)


async def with_tool(model: dflash2.Model, question: str) -> str:
    """Ask, run the calculator call the model writes, feed the result back, return the final answer."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    # the assistant's turn starts with the call, as agent frameworks prefill it; the model writes the expression
    prompt = model.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    written = await model.agenerate(prompt + "calculator(", max_new_tokens=16, stop=[")"])
    call = TOOL_CALL.search("calculator(" + written.text + ")")
    if call is None:
        return f"(no tool call in {written.text!r})"
    result = calculator(call.group(1))
    print(f"tool call: calculator({call.group(1)}) = {result:g}")
    messages += [
        {"role": "assistant", "content": call.group(0)},
        {"role": "user", "content": f"The calculator says {result:g}. Answer the question in one sentence."},
    ]
    return (await model.agenerate(messages, max_new_tokens=MAX_NEW_TOKENS)).text.strip()


async def plain(model: dflash2.Model, question: str) -> str:
    return (await model.agenerate([{"role": "user", "content": question}], max_new_tokens=MAX_NEW_TOKENS)).text.strip()


async def main() -> None:
    drafter = shipped_drafter()
    model = dflash2.load(smollm2_gguf(), drafter=["ngram", drafter] if drafter else "ngram")

    # a background stream the agent needs only the start of: an essay whose first sentence becomes a title
    title: list[str] = []

    async def first_sentence() -> str:
        essay = [{"role": "user", "content": "Write a long essay about arithmetic."}]
        async with model.stream(essay, max_new_tokens=400) as stream:
            async for token in stream:
                title.append(token.text)
                if "." in token.text:
                    break  # enough: leaving the stream cancels its generation within a step
        return f"{len(title)} tokens, finish_reason={stream.completion.finish_reason}"

    background = asyncio.create_task(first_sentence())
    # two sub-tasks at once, beside the essay: one needs the tool, one does not
    answers = await asyncio.gather(
        with_tool(model, "What is 12 times 7?"),
        plain(model, "Name the capital of France."),
    )
    for label, answer in zip(("with the calculator", "without tools"), answers, strict=True):
        print(f"answer ({label}): {answer}")
    print(f"cancelled the essay after its first sentence ({await background}): {''.join(title).strip()}")


if __name__ == "__main__":
    asyncio.run(main())
