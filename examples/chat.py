"""A terminal chat: answers stream as they are written, the conversation is remembered, and
Ctrl-C stops the answer being written (the chat goes on; Ctrl-C at the prompt or an empty
input stream ends it).

Run: python examples/chat.py   (offline, SmolLM2-135M-Instruct with the shipped drafter)
"""

import asyncio
import os
import signal
import sys

import dflash2
from dflash2.demo_model import shipped_drafter, smollm2_gguf

MAX_NEW_TOKENS = int(os.environ.get("DFLASH2_EXAMPLE_TOKENS", "256"))


async def reply(model: dflash2.Model, history: list[dict[str, str]], written: list[str]) -> None:
    async with model.stream(history, max_new_tokens=MAX_NEW_TOKENS) as stream:
        async for token in stream:
            written.append(token.text)
            print(token.text, end="", flush=True)


async def main() -> None:
    drafter = shipped_drafter()
    model = dflash2.load(smollm2_gguf(), drafter=["ngram", drafter] if drafter else "ngram")
    loop = asyncio.get_running_loop()
    history: list[dict[str, str]] = []
    while True:
        print("you> ", end="", flush=True)
        line = await asyncio.to_thread(sys.stdin.readline)
        if not line:  # end of input
            print()
            return
        if not line.strip():
            continue
        history.append({"role": "user", "content": line.strip()})
        written: list[str] = []
        print("bot> ", end="", flush=True)
        answer = asyncio.create_task(reply(model, history, written))
        loop.add_signal_handler(signal.SIGINT, answer.cancel)  # Ctrl-C: this answer only
        try:
            await answer
            print()
        except asyncio.CancelledError:
            print(" [stopped]")
        finally:
            loop.remove_signal_handler(signal.SIGINT)
        history.append({"role": "assistant", "content": "".join(written)})
        print(f"({len(history) // 2} turns remembered)", flush=True)


if __name__ == "__main__":
    asyncio.run(main())
