"""The decode loops of `melix-fsm generate`: one prompt streamed, or several batched.

Rules of this module:
- One prompt goes through `mtp_stream_generate` (text streamed to stdout unless --json);
  several run concurrently through `MTPBatchGenerator`, with `--stagger N` inserting
  one prompt every N generator steps (0: all at once).
- `drive_batch` is the one batch loop: the text path and `generate --vision`
  (melix_mlx.vlm.cli, whose generator takes prepared inputs) both run it, each giving
  its own insert callable.
- `tokens` are the generated ids with the terminating EOS/stop token excluded, as in
  mlx-lm's `generate` / `batch_generate`.
- The head slot holds an MTP head, a draft model (melix_mlx.decoding.draft_model) or nothing
  (plain decode); the loops do not care which.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def decode_single(
    model, tokenizer, head, prompt, args, k, sampler, machine, refusal, controller, kv
) -> dict[str, Any]:
    from melix_mlx.generate import mtp_stream_generate

    tokens: list[int] = []
    text = ""
    last = None
    for r in mtp_stream_generate(
        model,
        tokenizer,
        prompt,
        head,
        max_tokens=args.max_tokens,
        num_draft_tokens=k,
        sampler=sampler,
        machine=machine,
        refusal=refusal,
        controller=controller,
        max_kv_size=args.max_kv_size,
        prefill_step_size=args.prefill_step_size,
        **kv,
    ):
        if r.finish_reason != "stop":
            tokens.append(r.token)
        text += r.text
        if not args.json:
            print(r.text, end="", flush=True)
        last = r
    if not args.json:
        print()
    assert last is not None
    return {
        "prompt": prompt,
        "prompt_tokens": last.prompt_tokens,
        "tokens": tokens,
        "text": text,
        "finish_reason": last.finish_reason,
        "stats": last.stats.to_dict(),  # the typed record the library hands out (melix_fsm.stats)
        "prompt_tps": last.prompt_tps,
        "generation_tps": last.generation_tps,
    }


def decode_batched(
    model, tokenizer, head, prompts, args, k, sampler, refusal, controller
) -> list[dict[str, Any]]:
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    from melix_mlx.batch_generator import MTPBatchGenerator
    from melix_mlx.generate import encode_prompt

    wrapper = tokenizer if isinstance(tokenizer, TokenizerWrapper) else TokenizerWrapper(tokenizer)
    encoded = [encode_prompt(wrapper, p).tolist() for p in prompts]
    gen = MTPBatchGenerator(
        model,
        head,
        num_draft_tokens=k,
        max_tokens=args.max_tokens,
        sampler=sampler,
        stop_tokens=[[t] for t in wrapper.eos_token_ids],
        refusal=refusal,
        controller=controller,
        max_kv_size=args.max_kv_size,
        prefill_step_size=args.prefill_step_size,
    )
    results = [
        {"prompt": p, "prompt_tokens": len(e), "tokens": [], "finish_reason": None, "stats": None}
        for p, e in zip(prompts, encoded)
    ]
    drive_batch(gen, results, lambda rows: gen.insert([encoded[i] for i in rows]), args.stagger)
    for result in results:
        result["text"] = wrapper.decode(result["tokens"])
    return results


def check_decode_settings(args: Any) -> None:
    """The settings every decode path checks (the text path and --vision); ValueError if bad."""
    if args.max_tokens <= 0:
        raise ValueError("--max-tokens must be > 0")
    if args.temp < 0 or not 0 <= args.top_p <= 1:
        raise ValueError("--temp must be >= 0 and --top-p within [0, 1]")
    if args.stagger < 0:
        raise ValueError("--stagger must be >= 0")


def drive_batch(
    gen: Any,
    results: list[dict[str, Any]],
    insert: Callable[[list[int]], list[int]],
    stagger: int,
    on_token: Callable[[int], None] | None = None,
) -> None:
    """Run the batch generator ``gen`` until every row of ``results`` has finished, then close it.

    Rows join through ``insert`` (row indices -> the generator's uids, in order): all at
    once (``stagger`` 0) or one every ``stagger`` steps. Each row's result gets its tokens
    (the stop token excluded), its finish reason and its stats; ``on_token`` sees every
    kept token as it comes (streaming one row's text)."""
    index_of: dict[int, int] = {}
    waiting, done, step = list(range(len(results))), 0, 0
    while done < len(results):
        if waiting and (stagger == 0 or step % stagger == 0):
            batch = waiting if stagger == 0 else waiting[:1]
            for uid, i in zip(insert(batch), batch):
                index_of[uid] = i
            waiting = waiting[len(batch) :]
        _, generation = gen.next()
        step += 1
        for r in generation:
            result = results[index_of[r.uid]]
            if r.finish_reason != "stop":  # mlx-lm's batch_generate drops the stop token too
                result["tokens"].append(r.token)
                if on_token is not None:
                    on_token(r.token)
            if r.finish_reason is not None:
                result["finish_reason"] = r.finish_reason
                result["stats"] = r.stats.to_dict()
                done += 1
    gen.close()
