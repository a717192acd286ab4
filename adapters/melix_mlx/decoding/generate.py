"""MTP drop-ins for mlx-lm's `stream_generate` and `generate_step`.

Rules of this module:
- `mtp_stream_generate` is usable wherever `mlx_lm.generate.stream_generate` is: same
  arguments (plus the head), same response fields, same EOS and detokenizer semantics:
  an EOS token ends the stream without being detokenized, the final response carries
  `finish_reason` "stop" or "length" and the detokenizer's finalized last segment, and
  `max_tokens` counts every yielded token. Each response also carries `stats`, the
  decoder's statistics as a typed record (melix_fsm.stats.GenerationStats: lifecycle
  counters, per-position acceptance, forward counts, the live policy's block), and
  `receipt`, the run's receipt (melix_fsm.receipt.Receipt) when the head carries one.
- `num_draft_tokens` (an int or "auto") and `device_policy` ("auto", "force_on",
  "force_off") resolve as `melix-fsm generate` resolves its flags
  (melix_mlx.decoding.startup.activate): the same receipt, the same calibration (reused
  from the calibration cache), the same live controller, priced at the prompt plus half
  of `max_tokens`. Left out, they are what `load_with_heads` was given, else depth 1 with
  no policy (speculate every step, as before). `controller=` passes a hand-built
  controller instead of a policy. A bad value raises `SettingError` before any work.
- Stop sequences (`stop_sequences`, lists of token ids) end the stream like mlx-lm's
  `StopSequences` does in its batch generator: the token completing a sequence is the
  final response's token with finish_reason "stop". Like an EOS token, it is not
  detokenized; the earlier tokens of that sequence were already streamed.
- Which tokens come out is decided by `melix_mlx.decode.MTPDecoder` (the target model
  decides every token; drafts only change how many come per forward). Without a head,
  or when the decoder refuses speculation, it decodes plainly and says why in `stats`.
- Quantized KV takes mlx-lm's arguments (`kv_bits`, `kv_group_size`,
  `quantized_kv_start`) and gives mlx-lm's quantized-KV output (melix_mlx.decode).
- `max_kv_size` builds mlx-lm's rotating cache; the decoder speculates on it exactly
  (melix_mlx.runtime.window_kv) and gives mlx-lm's `max_kv_size` output.
- Options of `generate_step` that speculation cannot honour (`input_embeddings`) raise
  ValueError instead of being ignored.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import DEFAULT_QUANTIZED_KV_START, StopSequences, generation_stream, wired_limit
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.tokenizer_utils import TokenizerWrapper

from melix_fsm.lifecycle import SequenceMachine
from melix_fsm.receipt import Receipt, ServingContext
from melix_fsm.stats import GenerationStats

from .decode import MTPDecoder
from .startup import SettingError, activate

__all__ = [
    "MTPDecoder",
    "MTPGenerationResponse",
    "SettingError",
    "encode_prompt",
    "make_decoder",
    "mtp_generate_step",
    "mtp_stream_generate",
]

_UNSUPPORTED = ("input_embeddings",)


@dataclass
class MTPGenerationResponse:
    """mlx-lm's `GenerationResponse` fields plus the decoder's `stats`."""

    text: str
    token: int
    logprobs: mx.array
    from_draft: bool
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory: float
    finish_reason: str | None = None
    stats: GenerationStats | None = None  # the decode's statistics so far (typed; `to_json()`)
    receipt: Receipt | None = field(default=None, repr=False)  # the run's receipt, when resolved


def _check_options(kw: dict[str, Any]) -> None:
    for name in _UNSUPPORTED:
        if kw.pop(name, None) is not None:
            raise ValueError(f"{name} is not supported with MTP decoding")
    kw.pop("num_draft_tokens", None)  # mlx-lm passes it through for its draft model
    kw.pop("draft_model", None)
    if kw:
        raise TypeError(f"unexpected keyword arguments: {', '.join(sorted(kw))}")


def make_decoder(
    model: nn.Module,
    head: nn.Module | None,
    *,
    num_draft_tokens: int = 1,
    sampler: Callable[[mx.array], mx.array] | None = None,
    logits_processors: list[Any] | None = None,
    prompt_cache: list[Any] | None = None,
    max_kv_size: int | None = None,
    prefill_step_size: int = 2048,
    machine: SequenceMachine | None = None,
    refusal: str | None = None,
    controller: Any = None,
    clock: Any = None,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
    quantized_kv_start: int = DEFAULT_QUANTIZED_KV_START,
) -> MTPDecoder:
    """The decoder the two entry points use (exposed so callers can keep its stats)."""
    if prompt_cache is None and max_kv_size is not None:
        prompt_cache = make_prompt_cache(model, max_kv_size=max_kv_size)
    return MTPDecoder(
        model,
        head,
        num_draft_tokens=num_draft_tokens,
        sampler=sampler,
        logits_processors=logits_processors,
        prompt_cache=prompt_cache,
        prefill_step_size=prefill_step_size,
        machine=machine,
        refusal=refusal,
        controller=controller,
        clock=clock,
        kv_bits=kv_bits,
        kv_group_size=kv_group_size,
        quantized_kv_start=quantized_kv_start,
    )


def mtp_generate_step(
    prompt: mx.array,
    model: nn.Module,
    head: nn.Module | None,
    *,
    max_tokens: int = 256,
    num_draft_tokens: int = 1,
    sampler: Callable[[mx.array], mx.array] | None = None,
    logits_processors: list[Any] | None = None,
    prompt_cache: list[Any] | None = None,
    max_kv_size: int | None = None,
    prefill_step_size: int = 2048,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
    quantized_kv_start: int = DEFAULT_QUANTIZED_KV_START,
    **kw: Any,
) -> Iterator[tuple[int, mx.array, bool]]:
    """`generate_step` with an MTP head: yields `(token, logprobs, from_draft)`.

    The triple is `speculative_generate_step`'s; `max_tokens` of 0 yields nothing and
    -1 never stops, as in `generate_step`. Use `make_decoder` to keep the statistics.
    """
    _check_options(kw)
    if max_tokens == 0:
        return
    decoder = make_decoder(
        model,
        head,
        num_draft_tokens=num_draft_tokens,
        sampler=sampler,
        logits_processors=logits_processors,
        prompt_cache=prompt_cache,
        max_kv_size=max_kv_size,
        prefill_step_size=prefill_step_size,
        kv_bits=kv_bits,
        kv_group_size=kv_group_size,
        quantized_kv_start=quantized_kv_start,
    )
    yield from decoder.generate(prompt, max_tokens)


def encode_prompt(tokenizer: TokenizerWrapper, prompt: str | mx.array | list[int]) -> mx.array:
    """The prompt as mlx-lm's `stream_generate` encodes it."""
    if isinstance(prompt, mx.array):
        return prompt
    if isinstance(prompt, str):
        bos = tokenizer.bos_token
        prompt = tokenizer.encode(prompt, add_special_tokens=bos is None or not prompt.startswith(bos))
    return mx.array(prompt)


def mtp_stream_generate(
    model: nn.Module,
    tokenizer: Any,
    prompt: str | mx.array | list[int],
    head: nn.Module | None,
    max_tokens: int = 256,
    *,
    num_draft_tokens: int | Literal["auto"] | None = None,
    device_policy: Literal["auto", "force_on", "force_off"] | None = None,
    sampler: Callable[[mx.array], mx.array] | None = None,
    logits_processors: list[Any] | None = None,
    stop_sequences: Sequence[Sequence[int]] | None = None,
    prompt_cache: list[Any] | None = None,
    max_kv_size: int | None = None,
    prefill_step_size: int = 2048,
    prompt_progress_callback: Callable[[int, int], None] | None = None,
    stream: Any = generation_stream,
    machine: SequenceMachine | None = None,
    refusal: str | None = None,
    controller: Any = None,
    clock: Any = None,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
    quantized_kv_start: int = DEFAULT_QUANTIZED_KV_START,
    **kw: Any,
) -> Iterator[MTPGenerationResponse]:
    """`stream_generate` with an MTP head; see the module rules.

    `num_draft_tokens` / `device_policy`: see the module rules (docs/api/stability.md).
    `machine` is the sequence's lifecycle machine when the caller already resolved it
    (e.g. from a receipt); `refusal` forces plain decode and records the reason;
    `controller` (melix_fsm.policy.controller.LiveController) suspends and resumes speculation;
    `clock` (melix_mlx.runtime.cycle_clock.CycleClock) collects where each cycle's time goes.

    Over 80 lines: a drop-in, its keyword list is mlx-lm's `stream_generate`'s (a third of
    it), and its loop times prompt and generation exactly as mlx-lm's does.
    """
    if max_tokens == 0:
        raise ValueError("Maximum number of tokens must be non-zero (use -1 for no limit).")
    _check_options(kw)
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    prompt = encode_prompt(tokenizer, prompt)
    # priced at the context the run will hold, as `generate` prices its prompt
    run = activate(
        model,
        head,
        num_draft_tokens,
        device_policy,
        controller=controller,
        context=prompt.size + max(max_tokens, 0) // 2,
        serving=ServingContext(
            quantized_kv=kv_bits is not None, kv_group_size=kv_group_size if kv_bits else None
        ),
        machine=machine,
    )
    detokenizer = tokenizer.detokenizer
    eos = set(tokenizer.eos_token_ids)
    matcher = StopSequences([list(s) for s in stop_sequences] if stop_sequences else None).matcher()
    progress = prompt_progress_callback or (lambda *_: None)
    decoder = make_decoder(
        model,
        head,
        num_draft_tokens=run.k,
        sampler=sampler,
        logits_processors=logits_processors,
        prompt_cache=prompt_cache,
        max_kv_size=max_kv_size,
        prefill_step_size=prefill_step_size,
        machine=run.machine,
        refusal=refusal or run.refusal,
        controller=run.controller,
        clock=clock,
        kv_bits=kv_bits,
        kv_group_size=kv_group_size,
        quantized_kv_start=quantized_kv_start,
    )

    def response(
        token: int, logprobs: mx.array, from_draft: bool, n: int, finish: str | None
    ) -> MTPGenerationResponse:
        return MTPGenerationResponse(
            text=detokenizer.last_segment,
            token=token,
            logprobs=logprobs,
            from_draft=from_draft,
            prompt_tokens=prompt.size,
            prompt_tps=prompt_tps,
            generation_tokens=n + 1,
            generation_tps=(n + 1) / (time.perf_counter() - tic),
            peak_memory=mx.get_peak_memory() / 1e9,
            finish_reason=finish,
            stats=GenerationStats.of(decoder.stats),
            receipt=run.receipt,
        )

    with wired_limit(model, [stream]), mx.stream(stream):
        progress(0, prompt.size)
        tic = time.perf_counter()
        prompt_tps = 0.0
        stopped = False
        for n, (token, logprobs, from_draft) in enumerate(decoder.generate(prompt, max_tokens)):
            if n == 0:
                progress(prompt.size, prompt.size)
                prompt_tps = prompt.size / (time.perf_counter() - tic)
                tic = time.perf_counter()
            # advance the matcher on every token, as the batch generator does
            if matcher.advance(token) or token in eos:
                stopped = True
                break
            detokenizer.add_token(token)
            if (n + 1) == max_tokens:
                break
            yield response(token, logprobs, from_draft, n, None)
        detokenizer.finalize()
        yield response(token, logprobs, from_draft, n, "stop" if stopped else "length")
