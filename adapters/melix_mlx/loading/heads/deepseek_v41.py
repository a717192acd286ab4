"""DeepSeek-V4.1's DSpark block drafter (``mtp.{s}.*``) behind the head interface.

What the published drafter is (DeepSeek-V4.1-Flash ``inference/model.py``: ``DSparkBlock``,
``DSparkAttention``, ``DSparkMarkovHead``, ``DSparkConfidenceHead``,
``Transformer.forward`` / ``forward_spec``; SGLang serves it as method DSPARK):
- Config: ``dspark_block_size`` (B, 5 released), ``dspark_noise_token_id``,
  ``dspark_target_layer_ids`` (3 trunk layers), ``dspark_markov_rank``,
  ``dspark_n_routed_experts`` / ``dspark_num_experts_per_tok`` (the stages' own MoE size,
  the trunk's when absent), ``num_nextn_predict_layers`` stages (3 released).
- Tensors, published names: every stage ``mtp.{s}.`` is a trunk decoder block (``attn.*``
  of a window-only layer, ``ffn.*``, ``attn_norm``, ``ffn_norm``, ``hc_{attn,ffn}_*``);
  stage 0 adds ``main_proj`` [D, taps * D] and ``main_norm``; the last stage adds ``norm``,
  ``markov_head.embed`` [V, R], ``markov_head.head`` [V, R] and ``confidence_head.proj``
  [1, D + R]. No ``hc_head`` (V4.1 dropped it), no embedding or output matrix of its own:
  the trunk's ``embed`` and ``head`` are shared. mlx-lm's ``sanitize`` drops ``mtp.``; the
  stage tensors get here exactly the renames, expert stacking and fp8/fp4 repack that
  ``sanitize`` gives the trunk's layers (``from_hf`` runs it on them), norms as stored
  (plain w, no +1).
- Hidden it reads: the hyper-connection streams ENTERING each target layer (its
  attention input, not its output), averaged over the streams, concatenated in layer
  order: ``main_x = main_norm(main_proj(cat taps))``, one shared context for all stages.
  Each stage keeps its own window KV over the verified positions: ``kv_norm(wkv(main_x))``,
  RoPE at the position, fp8 round trip.
- One pass drafts a block: B positions at p + 1 .. p + B (p the last verified position
  whose taps are in the context), token ids ``[t_{p+1}, noise, ..., noise]``, streams
  replicated, identity pre-mix; through every stage (window attention: each block query
  sees the last ``sliding_window`` context rows up to p and the WHOLE block, non-causal,
  with the attention sink; then the stage MoE; hyper-connections as in the trunk);
  ``norm(collapse(streams, last pre-mix))`` through the shared lm_head gives base logits
  per block position. Draft i = sample(base_i + ``markov_head.head(markov_head.embed(
  previous token))``), the previous token being t_{p+1} for i = 0 and draft i - 1 after.
  ``confidence_head.proj(cat[pre-norm block hidden, markov embedding])`` scores each
  position's acceptance: the serving loop may cut the block there.
How it runs here (one head, ``STAGES_FORM_ONE_HEAD``: the loader reads the stages together):
- ``trunk(hidden, next_tokens, cache)`` (hidden ``[final | taps]``, runtime.hidden's taps,
  declared for the model when the head is built) writes each slot's context row into the
  stages' caches (one ``KVCache`` per stage, trimmed with the engine's head cache) and
  returns per slot a seed: ``(position, t_{p+1})`` int32. ``logits(seeds)`` runs the block
  pass at those slots only (the engine projects only the slot it drafts from) and returns
  draft 0's logits. ``chain_step(i, seeds, draft_{i-1})`` serves draft i from the block of
  the same seeds (computed again at step 1 from the rolled-back head cache, kept for the
  cycle's later steps: the engine hands chain steps the seeds, not the block, so a cycle
  at k >= 2 runs the block pass twice; nothing is carried between calls that an undone
  step could leave stale), with the Markov bias of the draft actually drawn. Beyond the
  block (i >= B) the last block position is reused.
- Depth is the controller's fixed k per cycle; the confidence head is loaded but gates
  nothing: gating would need the engine to read it before choosing k. Exactness does not
  depend on any of this: the verify decides every token.
- The context rows are masked by position, so the don't-care slots the engine feeds past
  a row's accepted length (and trims after) are invisible to the block pass.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any, ClassVar

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import deepseek_v41 as dsv41
from mlx_lm.models.cache import KVCache

from ..errors import MissingHeadWeights, UnsupportedModel
from ._base import MTPHeadBase

# The loader reads all mtp.{s} stages into this one head (they are one drafter, not one
# head layer per draft step).
STAGES_FORM_ONE_HEAD = True
_TOP = ("main_proj.", "main_norm.", "norm.", "markov_head.", "confidence_head.")


@dataclasses.dataclass(frozen=True)
class DSpark:
    """The drafter's config values (held by the head as ``dspark_config``, so a converted
    head carries them)."""

    block_size: int
    noise_token_id: int
    markov_rank: int
    stages: int
    n_routed_experts: int
    experts_per_tok: int
    target_layer_ids: tuple[int, ...]

    def array(self) -> mx.array:
        head = [self.block_size, self.noise_token_id, self.markov_rank, self.stages]
        return mx.array(
            [*head, self.n_routed_experts, self.experts_per_tok, *self.target_layer_ids], mx.int32
        )

    @classmethod
    def from_array(cls, a: mx.array) -> DSpark:
        v = [int(x) for x in a.tolist()]
        return cls(v[0], v[1], v[2], v[3], v[4], v[5], tuple(v[6:]))

    @classmethod
    def from_config(cls, config: dict[str, Any], stages: int) -> DSpark:
        missing = [
            k
            for k in ("dspark_block_size", "dspark_noise_token_id", "dspark_target_layer_ids")
            if k not in config
        ]
        if missing or int(config.get("dspark_block_size") or 0) < 1:
            raise MissingHeadWeights(
                f"deepseek_v41: the DSpark drafter needs config {missing or 'dspark_block_size > 0'}"
            )
        per_tok = config.get("dspark_num_experts_per_tok") or config.get("dspark_n_activated_experts")
        return cls(
            block_size=int(config["dspark_block_size"]),
            noise_token_id=int(config["dspark_noise_token_id"]),
            markov_rank=int(config.get("dspark_markov_rank", 256)),
            stages=stages,
            n_routed_experts=int(config.get("dspark_n_routed_experts") or config["n_routed_experts"]),
            experts_per_tok=int(per_tok or config["num_experts_per_tok"]),
            target_layer_ids=tuple(int(i) for i in config["dspark_target_layer_ids"]),
        )


class MarkovHead(nn.Module):
    """The bigram bias: ``head(embed(previous token))`` [.., V]."""

    def __init__(self, vocab: int, rank: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, rank)
        self.head = nn.Linear(rank, vocab, bias=False)

    def __call__(self, tokens: mx.array) -> mx.array:
        return self.head(self.embed(tokens))


class ConfidenceHead(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, 1, bias=False)


class _Scratch:
    """Plain holder (outside the parameter tree): the head cache the last trunk call wrote,
    and the block the current cycle's chain steps read."""

    def __init__(self) -> None:
        self.cache: list[Any] | None = None
        self.block: mx.array | None = None


class MTPHead(MTPHeadBase):
    FAMILY: ClassVar[str] = "deepseek_v41"
    # no fused input and no chaining: drafts 2..K come from the block pass (module rules);
    # the block's logits read the post-norm hidden
    CHAIN_POST_NORM: ClassVar[bool] = True
    CONCAT_ORDER: ClassVar[str] = "embedding_first"

    def __init__(self, args: Any, embed_tokens: nn.Module, lm_head: Any, dspark: DSpark) -> None:
        super().__init__(embed_tokens, lm_head)
        d, n = args.hidden_size, args.num_hidden_layers
        ratios = tuple(args.compress_ratios)
        if any(n + s < len(ratios) and ratios[n + s] for s in range(dspark.stages)):
            raise UnsupportedModel(
                "deepseek_v41: a DSpark stage attends over its window only (compress ratio 0)"
            )
        self.dspark_config = dspark.array()
        self.main_proj = nn.Linear(d * len(dspark.target_layer_ids), d, bias=False)
        self.main_norm = nn.RMSNorm(d, eps=args.rms_norm_eps)
        stage_args = dataclasses.replace(
            args, n_routed_experts=dspark.n_routed_experts, num_experts_per_tok=dspark.experts_per_tok
        )
        self.stages = [dsv41.DecoderLayer(stage_args, n + s) for s in range(dspark.stages)]
        self.norm = nn.RMSNorm(d, eps=args.rms_norm_eps)
        self.markov_head = MarkovHead(args.vocab_size, dspark.markov_rank)
        self.confidence_head = ConfidenceHead(d + dspark.markov_rank)
        self.NUM_LAYERS = dspark.stages
        self._dspark = dspark
        self._dim, self._window, self._hc = d, args.sliding_window, args.hc_mult
        self._scratch = _Scratch()

    @classmethod
    def from_model(
        cls, model: nn.Module, *, own_lm_head: bool = False, dspark: DSpark | None = None
    ) -> MTPHead:
        """A head (random weights) for `model`; its taps are declared for `model`."""
        from ...runtime.hidden import declare_taps, main_parts

        if dspark is None:
            raise UnsupportedModel(
                "deepseek_v41: the DSpark drafter's settings come from its config (from_hf)"
            )
        parts = main_parts(model)
        head = cls(parts.args, parts.embed_tokens, parts.lm_head, dspark)
        declare_taps(model, dspark.target_layer_ids)
        return head

    @classmethod
    def from_weights(
        cls, model: nn.Module, weights: dict[str, mx.array], *, own_lm_head: bool = False
    ) -> MTPHead:
        if "dspark_config" not in weights:
            raise MissingHeadWeights("deepseek_v41: head tensors lack dspark_config (read them with from_hf)")
        return cls.from_model(model, dspark=DSpark.from_array(weights["dspark_config"]))

    def make_cache(self) -> list[Any]:
        return [KVCache() for _ in self.stages]

    # -- the context ------------------------------------------------------------------
    def trunk(
        self, hidden: mx.array, next_tokens: mx.array, cache: list[Any] | None = None, mask: Any = None
    ) -> mx.array:
        """Write each slot's context row into the stages' caches; per slot the seed
        ``(position, t_{p+1})`` [B, L, 2] int32 (module rules)."""
        cache = self.make_cache() if cache is None else cache
        batch, length, width = hidden.shape
        taps = len(self._dspark.target_layer_ids)
        if width != self._dim * (1 + taps):
            raise UnsupportedModel(
                f"deepseek_v41: the drafter reads [final | {taps} taps] ({self._dim * (1 + taps)} features), "
                f"got {width}: declare its taps (runtime.hidden.declare_taps)"
            )
        start = cache[0].offset
        main_x = self.main_norm(self.main_proj(hidden[..., self._dim :]))
        for layer, c in zip(self.stages, cache, strict=True):
            kv = self._context_rows(layer.self_attn, main_x, start)[:, None]
            c.update_and_fetch(kv, kv)
        self._scratch.cache = cache
        positions = mx.broadcast_to(start + mx.arange(length, dtype=mx.int32), (batch, length))
        return mx.stack([positions, next_tokens.astype(mx.int32)], axis=-1)

    @staticmethod
    def _context_rows(attn: nn.Module, main_x: mx.array, start: Any) -> mx.array:
        kv = attn.kv_norm(attn.kv_proj(main_x))
        kv = dsv41._apply_rope(kv, attn.rope, rope_dim=attn.rope_dim, offset=start)
        return dsv41._fake_quant_fp8(kv, 32)

    # -- the block pass ----------------------------------------------------------------
    def block(self, seeds: mx.array) -> mx.array:
        """The block's pre-norm hidden [B, M, block, D] for seeds [B, M, 2]."""
        cache = self._scratch.cache
        if cache is None:
            raise RuntimeError("the DSpark block reads the context a trunk call wrote; none was written")
        batch, m, _ = seeds.shape
        n, size = batch * m, self._dspark.block_size
        pos, tok = seeds[..., 0].reshape(-1), seeds[..., 1].reshape(-1)
        noise = mx.full((n, size - 1), self._dspark.noise_token_id, dtype=mx.int32)
        x = self.embed(mx.concatenate([tok[:, None], noise], axis=1))
        x = mx.broadcast_to(x[:, :, None, :], (n, size, self._hc, self._dim))
        pre_mix = mx.zeros((n, size, self._hc), dtype=mx.float32)
        pre_mix[..., 0] = 1.0
        rows = mx.repeat(mx.arange(batch), m)[:, None]
        # the last `window` context rows up to p; the engine's later slots are masked out
        ctx_pos = pos[:, None] - self._window + 1 + mx.arange(self._window)[None]
        for layer, c in zip(self.stages, cache, strict=True):
            keys = c.keys[:, 0, : c.offset]
            valid = (ctx_pos >= 0) & (ctx_pos < c.offset)
            ctx = keys[rows, mx.clip(ctx_pos, 0, max(c.offset - 1, 0))]
            x, pre_mix = self._stage(layer, x, pre_mix, ctx, valid, pos + 1)
        return dsv41._collapse(x, pre_mix).reshape(batch, m, size, self._dim)

    def _stage(self, layer: nn.Module, x: mx.array, pre_mix: mx.array, ctx, valid, first) -> tuple:
        attn_pre, attn_post, attn_comb = layer.attn_hc(x)
        h = layer.input_layernorm(dsv41._collapse(x, pre_mix))
        h = self._attend(layer.self_attn, h, ctx, valid, first)
        x = dsv41._expand(h, x, attn_post, attn_comb)
        ffn_pre, ffn_post, ffn_comb = layer.ffn_hc(x)
        h = layer.mlp(layer.post_attention_layernorm(dsv41._collapse(x, attn_pre)))
        return dsv41._expand(h, x, ffn_post, ffn_comb), ffn_pre

    @staticmethod
    def _attend(attn: nn.Module, h: mx.array, ctx: mx.array, valid: mx.array, first: mx.array) -> mx.array:
        """Every block query over the context rows and the whole block (non-causal)."""
        n, size, _ = h.shape
        rope = {"rope_dim": attn.rope_dim, "offset": first}
        q = attn.q_b_proj(attn.q_a_norm(attn.q_a_proj(h))).reshape(n, size, attn.num_heads, attn.head_dim)
        q = dsv41._apply_rope(q, attn.rope, **rope)
        kv = dsv41._fake_quant_fp8(dsv41._apply_rope(attn.kv_norm(attn.kv_proj(h)), attn.rope, **rope), 32)
        keys = mx.concatenate([ctx.astype(kv.dtype), kv], axis=1).astype(mx.float32)[:, None]
        mask = mx.concatenate([valid, mx.ones((n, size), dtype=mx.bool_)], axis=1)[:, None, None, :]
        out = mx.fast.scaled_dot_product_attention(
            q.transpose(0, 2, 1, 3).astype(mx.float32),
            keys,
            keys,
            scale=attn.head_dim**-0.5,
            mask=mask,
            sinks=attn.sinks.astype(mx.float32),
        )
        out = out.transpose(0, 2, 1, 3).astype(q.dtype)
        out = dsv41._apply_rope(out, attn.rope, inverse=True, **rope)
        out = attn.o_a_proj(out.reshape(n * size, attn.o_groups, 1, -1), attn._group_ids)
        return attn.o_b_proj(out.reshape(n, size, -1))

    def _draft_logits(self, block: mx.array, index: int, previous: mx.array) -> mx.array:
        return self.main_lm_head(self.norm(block[:, :, index])) + self.markov_head(previous)

    def logits(self, head_hidden: mx.array) -> mx.array:
        """Draft 0's logits [B, M, V] at seeds [B, M, 2]: the block pass at those slots."""
        return self._draft_logits(self.block(head_hidden), 0, head_hidden[..., 1])

    def chain_step(self, step: int, hidden: mx.array, tokens: mx.array) -> tuple[mx.array, mx.array]:
        """Draft ``step`` >= 1 from the block of seeds `hidden`, biased by the previous
        draft `tokens` [B, 1]; the block is computed at step 1 and kept for the cycle."""
        if step < 1:
            raise ValueError("chain steps start at 1; step 0 is the head's own call")
        if step == 1 or self._scratch.block is None:
            self._scratch.block = self.block(hidden)
        index = min(step, self._dspark.block_size - 1)
        return self._draft_logits(self._scratch.block, index, tokens.astype(mx.int32)), hidden


def is_head_key(key: str, config: dict[str, Any]) -> bool:
    return key.startswith("mtp.")


def from_hf(raw: dict[str, mx.array], config: dict[str, Any], layer: int = 0) -> dict:
    """All stages' tensors (the one drafter) under ``MTPHead`` names; ``layer`` must be 0."""
    if layer != 0:
        return {}
    head = {f"layers.{k[len('mtp.') :]}": v for k, v in raw.items() if is_head_key(k, config)}
    stages = len({k.split(".")[1] for k in head})
    if not stages:
        return {}
    dspark = DSpark.from_config(config, stages)
    # mlx-lm's sanitize does to the stages what it does to the trunk's layers
    owner = SimpleNamespace(
        args=SimpleNamespace(o_groups=int(config["o_groups"]), n_routed_experts=dspark.n_routed_experts)
    )
    out: dict[str, mx.array] = {"dspark_config": dspark.array()}
    for key, value in dsv41.Model.sanitize(owner, head).items():
        stage, _, name = key.removeprefix("model.layers.").partition(".")
        out[name if name.startswith(_TOP) else f"stages.{stage}.{name}"] = value
    return out
