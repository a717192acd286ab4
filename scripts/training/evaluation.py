"""Held-out evaluation: main-model loss, and head acceptance teacher-forced (k=1) and on the
main model's own greedy continuations (k=1..3), where teacher forcing equals real greedy
verification; depth > 1 chains the head on its own output, pre- or post-norm.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import deepseek_v3 as dsv3
from mlx_lm.models.cache import KVCache, make_prompt_cache

from .deepseek_v3 import MTPHead, head_logits


def eval_main_loss(model: dsv3.Model, windows: np.ndarray, batch: int = 16) -> float:
    total, count = 0.0, 0
    for i in range(0, len(windows), batch):
        w = mx.array(windows[i : i + batch])
        loss = nn.losses.cross_entropy(model(w[:, :-1]), w[:, 1:], reduction="sum")
        total += loss.item()
        count += w[:, 1:].size
    return total / count


def eval_head_teacher_forced(
    head: MTPHead, main: dsv3.Model, windows: np.ndarray, batch: int = 16
) -> dict[str, float]:
    """k=1 on held-out text: head argmax at i vs the main argmax at i+1 (exact for k=1)."""
    hit = hit_data = main_data = n = 0
    for i in range(0, len(windows), batch):
        w = mx.array(windows[i : i + batch])
        h = main.model(w[:, :-1])
        g = mx.argmax(main.lm_head(h), axis=-1)  # main prediction of token j+1 at j
        x = head.hidden(h[:, :-1], main.model.embed_tokens(w[:, 1:-1]))
        d = mx.argmax(head_logits(head, main, x), axis=-1)  # prediction of token i+2
        hit += (d == g[:, 1:]).sum().item()
        hit_data += (d == w[:, 2:]).sum().item()
        main_data += (g == w[:, 1:]).sum().item()
        n += d.size
    return {
        "head_vs_main_argmax": hit / n,
        "head_vs_data": hit_data / n,
        "main_vs_data": main_data / (n + len(windows)),
        "positions": n,
    }


def greedy_continue(model: dsv3.Model, prompts: mx.array, new_tokens: int) -> mx.array:
    cache = make_prompt_cache(model)
    logits = model(prompts, cache=cache)
    out = [prompts]
    tok = mx.argmax(logits[:, -1:], axis=-1)
    for _ in range(new_tokens):
        out.append(tok)
        logits = model(tok, cache=cache)
        tok = mx.argmax(logits[:, -1:], axis=-1)
    mx.eval(out)
    return mx.concatenate(out, axis=1)


def eval_head_decode(
    head: MTPHead,
    main: dsv3.Model,
    prompts: np.ndarray,
    *,
    new_tokens: int,
    depth: int,
    chain: str,
) -> dict[str, Any]:
    """Exact greedy speculative acceptance: on the main model's own greedy continuation the
    verifier's outputs are the continuation itself, so teacher forcing is exact. The head's
    cache is primed with the prompt pairs, gets one real pair per position, and the k-1
    chained entries are trimmed away again (what a decoder does after verification).
    ``chain`` is the hidden fed back for depth > 1: "pre" (layer output) or "post"
    (after shared_head.norm)."""
    seqs = greedy_continue(main, mx.array(prompts), new_tokens)
    h = main.model(seqs)
    g = np.array(mx.argmax(main.lm_head(h), axis=-1))  # g[:, j] predicts token j+1
    emb = main.model.embed_tokens
    p = prompts.shape[1]
    cache = KVCache()
    # Prime with pairs (h_j, s_{j+1}) for j < p-1.
    head.hidden(h[:, : p - 1], emb(seqs[:, 1:p]), cache)
    total = seqs.shape[1]
    accepted_prefix = np.zeros(depth)  # positions whose first k drafts are all accepted
    positions = 0
    for i in range(p - 1, total - depth):
        x = head.hidden(h[:, i : i + 1], emb(seqs[:, i + 1 : i + 2]), cache)
        ok = np.ones(seqs.shape[0], dtype=bool)
        for k in range(depth):
            normed = head.shared_head.norm(x)
            d = mx.argmax(main.lm_head(normed), axis=-1)
            ok &= np.array(d[:, 0]) == g[:, i + 1 + k]
            accepted_prefix[k] += ok.sum()
            if k + 1 < depth:
                fed = normed if chain == "post" else x
                x = head.hidden(fed, emb(d), cache)
        cache.trim(depth - 1)
        positions += seqs.shape[0]
    rates = accepted_prefix / positions
    text_tokens = np.array(seqs[:, p:])
    return {
        "chain": chain,
        "all_first_k_accepted": {str(k + 1): round(float(r), 4) for k, r in enumerate(rates)},
        "conditional": {
            str(k + 1): round(float(rates[k] / (rates[k - 1] if k else 1.0)), 4)
            for k in range(depth)
            if k == 0 or rates[k - 1] > 0
        },
        "expected_tokens_per_verify": {
            str(k + 1): round(float(1 + rates[: k + 1].sum()), 4) for k in range(depth)
        },
        "positions": positions,
        "distinct_generated_token_fraction": round(
            float(np.mean([len(set(r.tolist())) / len(r) for r in text_tokens])), 4
        ),
    }


def head_acceptance(
    head: Any, main: Any, eval_w: np.ndarray, chain: str, log: Callable[[str], None]
) -> dict[str, Any]:
    """The report's ``acceptance``: teacher-forced k=1, and k=1..3 greedy decoding with both
    chain conventions on the first 64 tokens of 32 held-out windows, 64 greedy tokens each."""
    tf = eval_head_teacher_forced(head, main, eval_w)
    log(f"teacher-forced k=1 acceptance {tf['head_vs_main_argmax']:.3f}")
    prompts = eval_w[:32, :64]
    decode = {
        c: eval_head_decode(head, main, prompts, new_tokens=64, depth=3, chain=c)
        for c in ("post", "pre")
    }
    for c, r in decode.items():
        log(f"decode acceptance chain={c}: {r['all_first_k_accepted']}")
    best = max(decode, key=lambda c: sum(decode[c]["all_first_k_accepted"].values()))
    return {
        "teacher_forced_k1": tf,
        "greedy_decode": decode,
        "chain_hidden": best,
        "decoder_chain": chain,
        "chain_note": "depth>1 feeds the head's own output back as the hidden input "
                      "with its own drafted token; 'post' = after shared_head.norm, "
                      "'pre' = raw decoder-layer output",
    }
