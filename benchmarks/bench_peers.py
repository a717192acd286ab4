"""Peers on the same checkpoint: a peer's MTP decoding beside this project's and mlx-lm's,
interleaved in one run (greedy, held-out prompts, decode tokens/s, identity to mlx-lm).

Usage:
    python benchmarks/bench_peers.py --peer NAME=CHECKOUT | --peer mlx-vlm [--peer ...]
        [--model stdlib-hybrid-wide] [--batch-sizes 1 4] [--ks 2] [--rounds 3]
        [--max-tokens 48] [--regime openblas|reference|current] [--cells single batch]
        [--ideal] [--profile] [--out FILE]

`--peer mlx-vlm` (no checkout) is the installed mlx-vlm (`pip install 'melix-fsm[vlm]'`):
its MTP speculative decode at each k (`mlx-vlm MTP k=K`: `generate_step` / `BatchGenerator`
with the drafter `load_drafter(MODEL, kind="mtp")` builds from the checkpoint's head,
block size k + 1) and its plain decode (`mlx-vlm plain`), through
melix_mlx.tools.peers_vlm in a worker of its own. Each cell then also reports ours
against mlx-vlm's MTP at the same k: the per-round ratio of tokens/s (median, min-max) and
a verdict: `ahead` when every round is, `behind` when every round is behind, else `level`
(the spread of the rounds covers 1).
`--ideal` calibrates this project's forward times in the same run (after the rounds, at
the cells' context) and reports each speculative contender's ideal bound: B (1 + a) /
(t_verify + k t_head) tokens/s with a its own accepted drafts per row and round, and the
measured share of it. `--profile` puts, per k, the single-sequence cycle of both side by
side (ms per cycle): ours from the engine's cycle clock beside the calibrated verify and
head times; mlx-vlm's from peers_vlm.profile_cycles (each part evaluated before its clock
stops).

Each CHECKOUT is a peer's source tree that the user fetched (its `mlx_lm` package at the
top); this repository never vendors peer code. For example, the AirRunner mlx-lm fork:

    git clone https://github.com/AirRunner/mlx-lm /tmp/airrunner-native
    git -C /tmp/airrunner-native checkout feat/mtp-native    # single-sequence MTP
    git clone https://github.com/AirRunner/mlx-lm /tmp/airrunner-batched
    git -C /tmp/airrunner-batched checkout feat/mtp-batched  # batched MTP as well

Notes on the AirRunner fork (feat/mtp-batched @ dbe8b1b): its batched MTP crashes in
`GenerationBatch.filter` once a row finishes (`_draft_xtc_draws` is None under greedy
sampling; the MTP cache and draft arrays are indexed with an empty list when the last row
ends). The minimal fix applied to the local checkout before measuring (nothing else
changed; no effect on a step that has rows left):

    -            for c in self._mtp_cache:
    -                if hasattr(c, "filter"):
    +            for c in self._mtp_cache:
    +                if hasattr(c, "filter") and keep:
                         c.filter(keep)
    -            if self._draft_toks is not None:
    +            if self._draft_toks is not None and not keep:
    +                self._draft_toks = self._draft_lps = self._draft_accept_lps = None
    +                self._draft_xtc_draws = None
    +            elif self._draft_toks is not None:
                     self._draft_toks = self._draft_toks[keep]
                     ...
    -                self._draft_xtc_draws = [self._draft_xtc_draws[i] for i in keep]
    +                if self._draft_xtc_draws is not None:
    +                    self._draft_xtc_draws = [self._draft_xtc_draws[i] for i in keep]

feat/mtp-native @ f840f6c has no batched MTP (`BatchGenerator` takes no `mtp`): its batch
cells record that error.

How it runs (melix_mlx.tools.peer_bench, also behind `melix-fsm bench --peer`): one
worker process per contender (melix_mlx/tools/peer_worker.py) loads the
checkpoint once: `melix` (this project and mlx-lm's own paths, from the installed
mlx-lm) and one per peer (the same Python with the peer's checkout first on PYTHONPATH;
`--peer-python` picks another interpreter, e.g. a venv where the peer is installed). Per
round and cell the contenders decode the same prompts one after another, in an order that
rotates every round, so a drifting machine favours nobody. A cell is `single` (one
sequence: `stream_generate` / `mtp_stream_generate` / the peer's `stream_generate(...,
mtp=True)`) or `batch B` (B prompts inserted at once into mlx-lm's `BatchGenerator`,
`MTPBatchGenerator`, the peer's `BatchGenerator(..., mtp=True)`). A method a peer lacks,
or a crash, is recorded as that cell's error, never dropped.

Reported per cell and contender: decode tokens/s (median over runs), the ratio to mlx-lm
in the same round (median, min-max), and identity: runs whose tokens equal mlx-lm's
greedy tokens, with the first differing position where they do not. Results (with each
peer's commit where its checkout says it: a git work tree or a PEER_COMMIT file) are
written as JSON; a markdown table goes to stdout. Re-executes itself in the regime first.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "adapters"))

from melix_mlx.commands.bench import reexec_in_regime  # noqa: E402
from melix_mlx.tools.peer_bench import markdown, run, write  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peer", action="append", default=[], help="NAME=CHECKOUT (repeatable)")
    p.add_argument("--peer-python", default=None, help="interpreter for the peers (default: this one)")
    p.add_argument("--model", default="stdlib-hybrid-wide", help="folder, embedded name or widened preset")
    p.add_argument("--batch-sizes", type=int, nargs="*", default=[1, 4])
    p.add_argument("--ks", type=int, nargs="+", default=[2])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--prompt-chars", type=int, default=400, help="cut prompts to N characters (0: whole)")
    p.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="decode windows and calibration on the wall clock or each worker's CPU clock (a shared machine)",
    )
    p.add_argument("--cells", nargs="+", choices=["single", "batch"], default=["single", "batch"])
    p.add_argument("--ideal", action="store_true", help="calibrate after the rounds: each contender's ideal")
    p.add_argument("--profile", action="store_true", help="with --peer mlx-vlm: both cycles, part by part")
    p.add_argument("--regime", choices=["openblas", "reference", "current"], default="openblas")
    p.add_argument("--out", type=Path, default=None, help="JSON results (default: stdout table only)")
    args = p.parse_args()
    if args.regime != "current":
        reexec_in_regime(args.regime)
    args.command = ["python", "benchmarks/bench_peers.py", *sys.argv[1:]]
    result = run(args)
    if args.out is not None:
        write(result, args.out)
    print(markdown(result))


if __name__ == "__main__":
    main()
