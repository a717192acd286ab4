"""Fair prefill: a prompt's segments cut into chunks of a bounded number of tokens.

Rules of this module:
- MTPBatchGenerator's segment stage (melix_mlx.decoding.batch_surface) prefills at most one
  non-final segment per queued request in each `next()`, between the running rows'
  decode steps, and prefills the final segment at admission. Cutting every segment
  into chunks of at most `chunk` tokens therefore bounds the prompt work of one step
  (at most `prefill_batch_size` chunks in the segment stage plus as many at admission),
  so a long prompt never holds the other rows for more than that. The last piece, which
  is prefilled when the row joins the batch, may be cut shorter (`last`: what the step's
  time budget allows, melix_mlx.serve.prompt_work).
- The chunk boundaries the server made are not prompt-cache boundaries: `boundaries`
  gives the real ones (absolute token counts, counting the tokens a prompt cache already
  held), and the server reports only those as ends of segment to mlx-lm's loop, which
  stores a reusable prefix at each.
"""

from __future__ import annotations


def split_segments(
    segments: list[list[int]], held: int, chunk: int, last: int | None = None
) -> tuple[list[list[int]], set[int]]:
    """`segments` cut into pieces of at most `chunk` tokens, the very last piece into at
    most `last`; the real boundaries (see rules)."""
    pieces: list[list[int]] = []
    boundaries: set[int] = set()
    position = held
    kept = [list(s) for s in segments if len(s)]
    for i, segment in enumerate(kept):
        pieces += [segment[start : start + chunk] for start in range(0, len(segment), chunk)]
        position += len(segment)
        if i < len(kept) - 1:
            boundaries.add(position)
    if last is not None and pieces and len(pieces[-1]) > last:
        tail = pieces.pop()
        pieces += [tail[:-last], tail[-last:]]
    return pieces, boundaries
