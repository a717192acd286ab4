"""Function-preserving widening of a trained checkpoint: the tensor rules (numpy, no mlx).

Rules:
- The hidden size D grows to D' by appending dimensions that stay exactly zero in the
  residual stream: the embedding's new columns and every writing projection's new rows
  (``o_proj``, ``linear_attn.out_proj``, ``down_proj``, the MTP ``fc`` / ``eh_proj``) are
  zero, and so is every new norm weight.
- Norm exactness without touching eps: the residual stream is scaled by s = sqrt(D'/D)
  (embedding and writers times s), so the mean square over D' dims equals the original
  mean over D dims. Norms that feed a block (input / post-attention, MTP pre-fc norms)
  carry w/s; the final norms (main ``norm``, MTP ``norm`` / ``shared_head.norm``) keep w
  so their output, the hidden handed to the MTP head, is s times the original, and the
  lm_heads that read it carry 1/s. Scaling eps by D/D' instead would also perturb the
  per-head norms (q_norm, k_norm, GatedDeltaNet's gated norm) that share rms_norm_eps.
- Qwen3.5 stores its (1+w) norms as w: the rule works on the effective weight 1+w and
  stores it minus 1 again (new dims store -1, effective 0). The GatedDeltaNet norm is
  plain w (mlx-lm adds 1 only to the listed (1+w) norms).
- Extra heads (attention, GatedDeltaNet, MLA) and MLP units are appended; their output
  projection columns are zero. Grouped heads keep their key/value head: source query
  head j of group g sits at g*r' + j%r when the group size grows from r to r'.
- Unchanged: head dims, rope dims, MLA's kv / q LoRA ranks (their norms then stay
  exact), vocabulary, layer count, conv kernel.
- New input-side weights (rows of new heads / units, columns reading the new hidden
  dims, new conv channels) are seeded random with the source tensor's spread: their
  outputs are multiplied by zero, yet memory traffic and compute are realistic. Per-head
  vectors (A_log, dt_bias) draw from the source's own values. Deterministic: the seed of
  each tensor is (seed, crc32 of its canonical name).
- Fails closed: a tensor no rule names, MoE experts, quantized or tied weights raise
  ``WidenError``.
"""

from __future__ import annotations

import math
import re
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from melix_fsm.errors import MelixError


class WidenError(MelixError, ValueError):
    """A checkpoint or a size this widening cannot handle exactly."""


@dataclass(frozen=True)
class Axis:
    """Where a source axis's entries land in the widened axis (of `size` entries)."""

    size: int
    index: np.ndarray


def _blocks(unit_index: np.ndarray, units: int, block: int) -> Axis:
    """Per-unit blocks of `block` entries (a head's rows) following the units' map."""
    index = (unit_index[:, None] * block + np.arange(block)[None, :]).reshape(-1)
    return Axis(units * block, index)


def _grouped(groups: int, r: int, groups2: int, r2: int) -> np.ndarray:
    """Source head j (group j // r, slot j % r) -> its position with groups2 groups of r2."""
    j = np.arange(groups * r)
    return (j // r) * r2 + j % r


def _append(n: int) -> np.ndarray:
    return np.arange(n)


def _cat(*axes: Axis) -> Axis:
    """Axes laid end to end (a concatenated input or a fused projection's rows)."""
    parts, offset = [], 0
    for a in axes:
        parts.append(a.index + offset)
        offset += a.size
    return Axis(offset, np.concatenate(parts))


@dataclass(frozen=True)
class Sizes:
    """Widened sizes; None means scale with hidden (a head count keeps its group size)."""

    hidden: int
    intermediate: int | None = None
    heads: int | None = None
    kv_heads: int | None = None
    linear_key_heads: int | None = None
    linear_value_heads: int | None = None


def _scaled(n: int, factor: float, given: int | None, what: str) -> int:
    value = max(n, round(n * factor)) if given is None else given
    if value < n:
        raise WidenError(f"{what} {value} is smaller than the source's {n}")
    return value


def _groups(n_kv: int, n_q: int, factor: float, kv: int | None, q: int | None, what: str) -> tuple[int, int]:
    """(kv', q') for grouped heads: kv scales, the group size stays unless q is given."""
    if n_q % n_kv:
        raise WidenError(f"source {what}: {n_q} heads not a multiple of {n_kv} key heads")
    kv2 = _scaled(n_kv, factor, kv, f"{what} key heads")
    q2 = kv2 * (n_q // n_kv) if q is None else q
    if q2 % kv2 or q2 // kv2 < n_q // n_kv:
        raise WidenError(
            f"{what}: {q2} heads over {kv2} key heads must be a multiple with groups of at least "
            f"{n_q // n_kv} (the source's)"
        )
    return kv2, q2


class Plan:
    """The widened config and each tensor's rule for one source config."""

    def __init__(self, config: dict[str, Any], sizes: Sizes) -> None:
        self.config = config
        self.family = config.get("model_type")
        self.text = config.get("text_config", config)
        t = self.text
        d = int(t["hidden_size"])
        if sizes.hidden < d:
            raise WidenError(f"--hidden {sizes.hidden} is smaller than the source's hidden size {d}")
        if t.get("tie_word_embeddings") or config.get("tie_word_embeddings"):
            raise WidenError("tied embeddings: the embedding (x s) and lm_head (/ s) cannot share a tensor")
        if config.get("quantization") or t.get("quantization"):
            raise WidenError("quantized checkpoint: widen the float checkpoint first")
        factor = sizes.hidden / d
        self.s = math.sqrt(sizes.hidden / d)
        self.new = dict(t)
        self.new["hidden_size"] = sizes.hidden
        self.one_plus = False  # Qwen3.5 raw HF (1+w) norms; set from the tensors in `check`
        inter = _scaled(int(t["intermediate_size"]), factor, sizes.intermediate, "intermediate size")
        self.new["intermediate_size"] = inter
        ax: dict[str, Axis] = {
            "hidden": Axis(sizes.hidden, _append(d)),
            "units": Axis(inter, _append(int(t["intermediate_size"]))),
        }
        ax["concat"] = _cat(ax["hidden"], ax["hidden"])  # MTP fc / eh_proj input: [emb, hidden]
        if self.family in ("qwen3_5", "qwen3_5_text"):
            self._qwen3_5(t, sizes, factor, ax)
        elif self.family == "deepseek_v3":
            self._deepseek_v3(t, sizes, factor, ax)
        else:
            raise WidenError(f"model_type {self.family!r}: widening knows qwen3_5 and deepseek_v3")
        self.axes = ax

    def _qwen3_5(self, t: dict, sizes: Sizes, factor: float, ax: dict[str, Axis]) -> None:
        if int(t.get("num_experts") or 0) > 0:
            raise WidenError("sparse-MoE layers are not widened (dense MLPs only)")
        hd = int(t.get("head_dim") or t["hidden_size"] // t["num_attention_heads"])
        kv, q = int(t["num_key_value_heads"]), int(t["num_attention_heads"])
        kv2, q2 = _groups(kv, q, factor, sizes.kv_heads, sizes.heads, "attention")
        heads = _grouped(kv, q // kv, kv2, q2 // kv2)
        ax["attn_q"] = _blocks(heads, q2, 2 * hd)  # per head: [query, output gate]
        ax["attn_kv"] = _blocks(_append(kv), kv2, hd)
        ax["attn_o"] = _blocks(heads, q2, hd)
        nk, nv = int(t["linear_num_key_heads"]), int(t["linear_num_value_heads"])
        dk, dv = int(t["linear_key_head_dim"]), int(t["linear_value_head_dim"])
        nk2, nv2 = _groups(
            nk, nv, factor, sizes.linear_key_heads, sizes.linear_value_heads, "linear attention"
        )
        vheads = _grouped(nk, nv // nk, nk2, nv2 // nk2)
        key = _blocks(_append(nk), nk2, dk)
        ax["gdn_qkv"] = _cat(key, key, _blocks(vheads, nv2, dv))  # conv channels: [q, k, v]
        ax["gdn_v"] = Axis(nv2, vheads)
        ax["gdn_z"] = _blocks(vheads, nv2, dv)
        self.new.update(
            head_dim=hd,
            num_attention_heads=q2,
            num_key_value_heads=kv2,
            linear_num_key_heads=nk2,
            linear_num_value_heads=nv2,
        )

    def _deepseek_v3(self, t: dict, sizes: Sizes, factor: float, ax: dict[str, Axis]) -> None:
        layers = int(t["num_hidden_layers"]) + int(t.get("num_nextn_predict_layers") or 0)
        if t.get("n_routed_experts") and int(t.get("first_k_dense_replace") or 0) < layers:
            raise WidenError(
                "MoE layers are not widened (dense layers only: first_k_dense_replace too small)"
            )
        h = int(t["num_attention_heads"])
        h2 = _scaled(h, factor, sizes.heads, "attention heads")
        qhd = int(t["qk_nope_head_dim"]) + int(t["qk_rope_head_dim"])
        heads = _append(h)
        ax["mla_q"] = _blocks(heads, h2, qhd)
        ax["mla_kvb"] = _blocks(heads, h2, int(t["qk_nope_head_dim"]) + int(t["v_head_dim"]))
        ax["mla_o"] = _blocks(heads, h2, int(t["v_head_dim"]))
        self.new.update(num_attention_heads=h2, num_key_value_heads=h2)

    def widened_config(self) -> dict[str, Any]:
        if "text_config" in self.config:
            return {**self.config, "text_config": self.new}
        return dict(self.new)

    # ------------------------------------------------------------------ tensor rules
    def rule(self, name: str) -> tuple[str, tuple[str | None, ...]]:
        """(kind, per-axis space names) for tensor `name`; kinds in `widen_tensor`."""
        for pattern, kind, axes in _RULES:
            if re.search(pattern, name):
                if any(a is not None and a not in self.axes for a in axes):
                    continue  # the other family's rule for the same name
                return kind, axes
        raise WidenError(f"no widening rule for tensor {name!r} ({self.family})")

    def shape(self, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        _, axes = self.rule(name)
        if len(axes) != len(shape):
            raise WidenError(f"tensor {name!r}: {len(shape)} axes, the rule expects {len(axes)}")
        out = []
        for a, n in zip(axes, shape):
            if a is not None and self.axes[a].index.size != n:
                raise WidenError(
                    f"tensor {name!r}: axis of {n} entries, the config implies {self.axes[a].index.size}"
                )
            out.append(self.axes[a].size if a is not None else n)
        return tuple(out)

    def widen_tensor(self, name: str, src: np.ndarray, seed: int) -> np.ndarray:
        """The widened tensor for `name` (same dtype as `src`)."""
        kind, axes = self.rule(name)
        shape = self.shape(name, tuple(src.shape))
        rng = np.random.default_rng([seed, zlib.crc32(_canonical(name).encode())])
        if kind == "keep":
            return src
        x = src.astype(np.float32)
        if kind in ("norm_in", "norm_final"):
            eff = x + 1.0 if self._is_one_plus(name) else x
            eff = eff / self.s if kind == "norm_in" else eff
            out = np.zeros(shape, np.float32)
            out[self.axes[axes[0]].index] = eff
            if self._is_one_plus(name):
                out -= 1.0
            return out.astype(src.dtype)
        if kind in ("writer", "embed"):
            out = np.zeros(shape, np.float32)
            x = x * self.s
        elif kind == "vector":
            out = rng.choice(x.reshape(-1), size=shape).astype(np.float32)
        else:  # reader / lm_head: new inputs read zeros, new outputs are never used
            spread = float(x.std()) or 0.02
            out = rng.standard_normal(shape, dtype=np.float32) * np.float32(spread)
            if kind == "lm_head":
                x = x / self.s
        index = np.ix_(
            *[self.axes[a].index if a is not None else np.arange(n) for a, n in zip(axes, src.shape)]
        )
        out[index] = x
        return out.astype(src.dtype)

    def _is_one_plus(self, name: str) -> bool:
        """Qwen3.5 raw (1+w) norms: mlx-lm repairs the main ones when conv1d is unsanitized,
        the project's head loader repairs every ``mtp.*`` norm."""
        if self.family not in ("qwen3_5", "qwen3_5_text") or "linear_attn.norm" in name:
            return False
        return self.one_plus or name.startswith("mtp.") or ".mtp." in name

    def check(self, shapes: dict[str, tuple[int, ...]]) -> None:
        """Reject what the rules cannot keep exact, before anything is written."""
        for name in shapes:
            if name.endswith((".scales", ".biases")) or "experts" in name:
                raise WidenError(f"tensor {name!r}: quantized or MoE weights are not widened")
        self.one_plus = any("conv1d.weight" in k and v[-1] != 1 for k, v in shapes.items())
        for name, shape in shapes.items():
            self.shape(name, shape)


def _canonical(name: str) -> str:
    """Shared copies (the DeepSeek head's embedding / lm_head) seed like the main tensors."""
    if name.endswith("shared_head.head.weight"):
        return "lm_head.weight"
    if re.search(r"layers\.\d+\.embed_tokens\.weight$", name):
        return "model.embed_tokens.weight"
    return name


H = "hidden"
# (pattern, kind, axes) -- first match wins; patterns name the tensor's role, not its layer.
_RULES: tuple[tuple[str, str, tuple[str | None, ...]], ...] = (
    (r"embed_tokens\.weight$", "embed", (None, H)),
    (r"(^lm_head|shared_head\.head)\.weight$", "lm_head", (None, H)),
    (r"(input_layernorm|post_attention_layernorm|pre_fc_norm_\w+|enorm|hnorm)\.weight$", "norm_in", (H,)),
    (r"(^model\.norm|language_model\.norm|^mtp\.norm|shared_head\.norm)\.weight$", "norm_final", (H,)),
    (r"(mtp\.fc|eh_proj)\.weight$", "writer", (H, "concat")),
    (r"mlp\.(gate_proj|up_proj)\.weight$", "reader", ("units", H)),
    (r"mlp\.down_proj\.weight$", "writer", (H, "units")),
    # Qwen3.5 full attention (q_proj rows: per head [query, gate])
    (r"self_attn\.q_proj\.weight$", "reader", ("attn_q", H)),
    (r"self_attn\.(k_proj|v_proj)\.weight$", "reader", ("attn_kv", H)),
    (r"self_attn\.(q_norm|k_norm)\.weight$", "keep", (None,)),
    (r"self_attn\.o_proj\.weight$", "writer", (H, "attn_o")),
    # Qwen3.5 GatedDeltaNet
    (r"linear_attn\.in_proj_qkv\.weight$", "reader", ("gdn_qkv", H)),
    (r"linear_attn\.conv1d\.weight$", "reader", ("gdn_qkv", None, None)),
    (r"linear_attn\.in_proj_z\.weight$", "reader", ("gdn_z", H)),
    (r"linear_attn\.in_proj_[ab]\.weight$", "reader", ("gdn_v", H)),
    (r"linear_attn\.(A_log|dt_bias)$", "vector", ("gdn_v",)),
    (r"linear_attn\.norm\.weight$", "keep", (None,)),
    (r"linear_attn\.out_proj\.weight$", "writer", (H, "gdn_z")),
    # DeepSeek-V3 MLA (LoRA ranks unchanged)
    (r"self_attn\.q_proj\.weight$", "reader", ("mla_q", H)),
    (r"self_attn\.q_a_proj\.weight$", "reader", (None, H)),
    (r"self_attn\.q_b_proj\.weight$", "reader", ("mla_q", None)),
    (r"self_attn\.kv_a_proj_with_mqa\.weight$", "reader", (None, H)),
    (r"self_attn\.(kv_a_layernorm|q_a_layernorm)\.weight$", "keep", (None,)),
    (r"self_attn\.kv_b_proj\.weight$", "reader", ("mla_kvb", None)),
    (r"self_attn\.o_proj\.weight$", "writer", (H, "mla_o")),
)
