"""Embedding MTP in an existing mlx-lm `stream_generate` loop: change the call, keep the loop.

Before:

    model, tokenizer = mlx_lm.load(path)
    for response in stream_generate(model, tokenizer, prompt, max_tokens=64):
        on_text(response.text)

After: `load_with_heads` keeps the MTP head mlx-lm's loader drops, and
`mtp_stream_generate` takes the same arguments plus the head. `num_draft_tokens="auto"`
runs the start-up `melix-fsm generate` runs: the receipt, this machine's calibration
(cached per model and machine), and the live controller that switches speculation off
where it does not pay. The text is mlx-lm's own greedy text, token for token.

Run: python examples/stream_generate_loop.py [MODEL]   (default: the embedded stdlib-tiny)
"""

from __future__ import annotations

import sys

from melix_mlx.generate import mtp_stream_generate
from melix_mlx.loading import load_with_heads
from mlx_lm.generate import stream_generate

PROMPT = "def parse_args(argv):"


def main(model_name: str = "stdlib-tiny") -> None:
    model, tokenizer, head, info = load_with_heads(model_name)

    plain = "".join(r.text for r in stream_generate(model, tokenizer, PROMPT, max_tokens=48))

    pieces = []
    for response in mtp_stream_generate(  # the same loop, one call changed
        model, tokenizer, PROMPT, head, max_tokens=48, num_draft_tokens="auto"
    ):
        pieces.append(response.text)
        print(response.text, end="", flush=True)
    print()

    assert "".join(pieces) == plain, "MTP must reproduce mlx-lm's greedy text"
    stats, receipt = response.stats, response.receipt
    print(
        f"mode={receipt.mode} gate={receipt.hardware_gate} k_max={stats.policy.k_max} "
        f"drafts accepted {stats.accepted}/{stats.proposed}, "
        f"{response.generation_tps:.1f} tok/s (same text as stream_generate)"
    )


if __name__ == "__main__":
    main(*sys.argv[1:])
