"""Replacing mlx-lm's `BatchGenerator` in a custom server loop with `MTPBatchGenerator`.

A server loop that owns a queue of requests, inserts them into the generator, steps it
and routes each response to its request keeps working unchanged: `MTPBatchGenerator`
has `BatchGenerator`'s surface (`insert`, `next_generated`, `remove`, `close`, ...). One
step may return several responses for the same uid (every token a verify accepted), in
order, so the loop must append rather than assume one token per uid per step. The
finishing response carries the row's typed statistics (`response.stats`), the generator
the batched receipt (`gen.receipt`).

Run: python examples/custom_server_loop.py [MODEL]   (default: the embedded stdlib-tiny)
"""

from __future__ import annotations

import sys
from collections import deque
from dataclasses import dataclass, field

from melix_mlx.batch_generator import MTPBatchGenerator
from melix_mlx.loading import load_with_heads
from mlx_lm.generate import BatchGenerator

PROMPTS = ["import os", "def parse_args(argv):", "class Config:"]


@dataclass
class Request:
    prompt: str
    max_tokens: int
    tokens: list[int] = field(default_factory=list)
    done: bool = False
    stats: object = None


def serve(gen, tokenizer, requests: list[Request], arrive_every: int = 2) -> None:
    """The server's loop: a request arrives every few steps; responses are routed by uid."""
    queue, by_uid, step = deque(requests), {}, 0
    while queue or any(not r.done for r in by_uid.values()):
        if queue and step % arrive_every == 0:
            request = queue.popleft()
            (uid,) = gen.insert([tokenizer.encode(request.prompt)], max_tokens=[request.max_tokens])
            by_uid[uid] = request
        for response in gen.next_generated():
            request = by_uid[response.uid]
            request.tokens.append(response.token)
            if response.finish_reason is not None:
                request.done, request.stats = True, getattr(response, "stats", None)
        step += 1
    gen.close()


def main(model_name: str = "stdlib-tiny") -> None:
    model, tokenizer, head, _ = load_with_heads(model_name)
    eos = [[t] for t in tokenizer.eos_token_ids]

    plain = [Request(p, 32) for p in PROMPTS]
    serve(BatchGenerator(model, max_tokens=32, stop_tokens=eos), tokenizer, plain)

    mtp = [Request(p, 32) for p in PROMPTS]
    gen = MTPBatchGenerator(model, head, max_tokens=32, stop_tokens=eos, num_draft_tokens="auto")
    serve(gen, tokenizer, mtp)

    for a, b in zip(plain, mtp):
        assert a.tokens == b.tokens, "MTP must reproduce BatchGenerator's greedy tokens"
        print(f"{b.prompt!r}: {tokenizer.decode(b.tokens)!r}")
        print(f"    accepted {b.stats.accepted}/{b.stats.proposed} drafts, state {b.stats.state}")
    print(f"receipt: {gen.receipt.mode}, batched={gen.receipt.batched}, gate {gen.receipt.hardware_gate}")


if __name__ == "__main__":
    main(*sys.argv[1:])
