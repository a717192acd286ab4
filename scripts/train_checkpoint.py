"""Train ``stdlib-tiny`` (DeepSeek-V3) or ``stdlib-hybrid`` (Qwen3.5): a trained native MTP head.
(A script, not library code: over 400 lines because data, both families' models, the head
objectives, evaluation and the report are one reproducible recipe. Splitting it is open work.)

The project's embedded default model (README main command, benchmarks), and with
``--no-head`` its draft model ``stdlib-tiny-draft`` for mlx-lm's own speculative decoding.
Everything is rebuilt from text present on every machine: the running interpreter's own
standard library.

Architecture: defaults are the embedded target, 8 dense main layers (hidden 192, MLP 512,
4 MLA heads) and ONE dense MTP layer, so that, as in real MTP models (1 head layer against
dozens of main layers), the head costs a small fraction of a main forward. ``--layers``,
``--hidden``, ``--intermediate``, ``--heads`` change the main model; ``--moe-head`` makes
the MTP layer MoE (``first_k_dense_replace = num_hidden_layers``; the default dense head
uses ``num_hidden_layers + 1``, also a valid DeepSeek-V3 config). The tokenizer does not
depend on any of these options (same files, same settings, same vocabulary), so every model
trained by this script shares one ``tokenizer.json`` byte for byte; ``--tokenizer-like DIR``
asserts it against another checkpoint.

Rules this script keeps:

* Data: the top-level ``*.py`` files of ``sysconfig.get_paths()['stdlib']`` in sorted order,
  minus machine-specific ``_sysconfigdata*``; every ``EVAL_EVERY``-th file (index ``% EVAL_EVERY
  == EVAL_OFFSET``) is held out for evaluation and never seen by the tokenizer or the model.
  The exact file list, sizes and hashes go into ``training_report.json``, so a rebuild on
  another Python version is visibly a different data set.
* Deterministic: fixed file order, ``--seed`` drives ``mx.random`` (init) and a numpy
  generator (batches); the tokenizer trainer runs single-threaded. Same machine, same BLAS,
  same seed -> same bytes.
* The main model is ``mlx_lm.models.deepseek_v3.Model`` itself, so the trained forward is the
  one inference runs. Saved weights use Hugging Face DeepSeek-V3 names (the inverse of
  mlx-lm's ``sanitize``: ``kv_b_proj`` re-joined from ``embed_q``/``unembed_out``, experts
  unstacked).
* The MTP head follows DeepSeek-V3: ``x = eh_proj(cat[enorm(embed(t_{i+1})), hnorm(h_i)])``
  (embedding first), one decoder layer (MLA; dense by default, MoE with ``--moe-head`` because
  its index ``num_hidden_layers`` is then ``>= first_k_dense_replace``), ``logits =
  shared_head.head(shared_head.norm(x))``. The head shares the main ``embed_tokens`` and
  ``lm_head`` (frozen while it trains); like the public DeepSeek-V3 checkpoint, copies are
  stored under the head as ``embed_tokens`` and ``shared_head.head``. It is trained by
  self-distillation against a frozen main model: the target at pair i is the main model's
  argmax at i+1 (``--head-target distill``). On the earlier 2-layer checkpoint (300-step main
  model, MoE head, 100 head steps), held-out k=1 acceptance was 0.60 for it, 0.50 for
  full-distribution distillation (``soft``) and 0.43 for the data token t_{i+2} (``data``):
  acceptance is agreement with the main model, so imitate the main model.
* Evaluation: k=1 teacher-forced on held-out text (exact for k=1), and k=1..3 on the main
  model's own greedy continuations of held-out prompts, where teacher forcing equals real
  greedy verification; depth > 1 chains the head on its own output, both with the pre-norm
  and the post-``shared_head.norm`` hidden (the better one is recorded as ``chain_hidden``).
* Head tensors live in ``mtp.safetensors`` under ``model.layers.{num_hidden_layers}.*``;
  ``model.safetensors`` holds the main model only. Why: mlx-lm 0.32's deepseek_v3
  ``sanitize`` drops only the literal prefix ``model.layers.61``, so a head at any other index
  inside ``model*.safetensors`` makes the strict ``mlx_lm.load`` fail. ``mtp.safetensors`` is
  outside mlx-lm's ``model*.safetensors`` glob; ``model.safetensors.index.json`` maps every
  tensor (main and head) to its file, as Hugging Face sharded checkpoints do.
* ``--family qwen3_5`` builds ``stdlib-hybrid`` instead: the Qwen3.5 hybrid layout
  (``model_type`` ``qwen3_5`` with ``text_config``; GatedDeltaNet linear-attention layers
  and a full-attention layer every ``--full-attention-interval``). The main model is
  ``mlx_lm.models.qwen3_5.Model`` itself and the head is the project's own
  ``melix_mlx.heads.qwen3_5.MTPHead`` (``fc(cat[norm_e(emb), norm_h(h)])`` -> one
  full-attention layer -> ``mtp.norm`` -> the main lm_head), so both train with the forward
  inference runs. Saved in the Hugging Face layout: ``model.language_model.*``, conv1d as
  ``[C, 1, K]``, every (1+w) RMSNorm stored as w, the head under ``mtp.*`` inside
  ``model.safetensors`` (mlx-lm's ``sanitize`` drops ``mtp.`` keys; the project's loader
  reads them back and adds the 1). Same data, tokenizer, self-distillation and evaluation.
* Depth 2 (``--chain-loss-weight W``): the decoder's second draft feeds the head its own
  output for pair i (pre- or post-norm, the family head class's ``CHAIN_POST_NORM``) with
  the first draft, attending to the head cache's real pairs 0..i plus that chained entry.
  Training runs exactly that for all pairs at once (the chained entries at RoPE position
  i + 1, a mask over the first step's keys plus their own), with the data token t_{i+2}
  (what the verifier emits when the first draft is accepted) and the main model's argmax
  at i+2 as target; loss = step-1 loss + W * step-2 loss. ``--head-pool-rows R`` draws R
  rows of each head batch from the main model's own greedy continuations of
  training-text prompts (the text a head drafts on when greedy decoding runs), the rest
  from training text. ``--init-from DIR --init-head --steps 0`` retrains the head alone,
  starting from DIR's head, on DIR's main model unchanged.
* Depth growth (``--grow-from DIR``, qwen3_5): a deeper main model starts from DIR's
  shallower one of the same widths: DIR's layers, block by block (one full-attention
  period), are copied in order into evenly spread blocks, the new layers' residual-branch
  output projections are zeroed, so the grown model computes DIR's function exactly
  before training continues all layers.
* OpenBLAS: mlx's CPU wheel ships reference BLAS (~8x slower here). When Debian's OpenBLAS
  exists and is not preloaded, the script re-executes itself with ``LD_PRELOAD`` (disable with
  ``--no-openblas``). Both paths work; the report records which BLAS ran.

Usage::

    python scripts/train_checkpoint.py --out adapters/melix_mlx/assets/stdlib-tiny
    python scripts/train_checkpoint.py --out adapters/melix_mlx/assets/stdlib-tiny-draft \
        --no-head --layers 2 --hidden 128 --intermediate 384 \
        --tokenizer-like adapters/melix_mlx/assets/stdlib-tiny

    python scripts/train_checkpoint.py --family qwen3_5 \
        --out adapters/melix_mlx/assets/stdlib-hybrid \
        --tokenizer-like adapters/melix_mlx/assets/stdlib-tiny

(The exact command of each embedded checkpoint is its ``training_report.json["command"]``.)

Other options: ``--seed S --steps N --head-steps N --moe-head --dtype ...`` (see ``--help``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import sys
import sysconfig
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "adapters/melix_mlx/assets/stdlib-tiny"
EOS = "<|endoftext|>"
EVAL_EVERY = 10
EVAL_OFFSET = 3


def _maybe_reexec_with_openblas(argv: list[str], disabled: bool) -> None:
    """Re-run this process with OpenBLAS preloaded (must happen at process start)."""
    preload = os.environ.get("LD_PRELOAD", "")
    if disabled or "libopenblas" in preload or not os.path.exists(OPENBLAS):
        return
    if os.environ.get("MELIX_TRAIN_REEXEC") == "1":  # guard against an exec loop
        return
    env = dict(os.environ)
    env["LD_PRELOAD"] = f"{OPENBLAS}:{preload}" if preload else OPENBLAS
    env["MELIX_TRAIN_REEXEC"] = "1"
    print(f"[train] re-executing with LD_PRELOAD={OPENBLAS}", flush=True)
    os.execve(sys.executable, [sys.executable, *argv], env)


# Heavy imports after the optional re-exec decision is cheap to take; they are module level
# so the helpers below stay importable by tests.
import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import mlx.optimizers as optim  # noqa: E402
import numpy as np  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from mlx_lm.models import deepseek_v3 as dsv3  # noqa: E402
from mlx_lm.models import qwen3_5 as q35  # noqa: E402
from mlx_lm.models.base import create_attention_mask  # noqa: E402
from mlx_lm.models.cache import KVCache, make_prompt_cache  # noqa: E402

# --------------------------------------------------------------------------------------
# Model configuration (Hugging Face config.json fields; ModelArgs ignores the extra ones)
# --------------------------------------------------------------------------------------


def model_config(
    vocab_size: int,
    eos_id: int,
    *,
    layers: int = 8,
    hidden: int = 192,
    intermediate: int = 512,
    heads: int = 4,
    moe_head: bool = False,
    moe_intermediate: int | None = None,
    mtp: bool = True,
) -> dict[str, Any]:
    """The checkpoint's config.json. Main layers are dense. The MTP layer (index ``layers``)
    is dense by default (``first_k_dense_replace = layers + 1 > num_hidden_layers``, a valid
    DeepSeek-V3 config); ``moe_head`` makes it MoE (``first_k_dense_replace = layers``).
    ``mtp=False`` (a draft model) advertises no MTP layer."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "moe_intermediate_size": moe_intermediate or hidden,
        "num_hidden_layers": layers,
        "num_nextn_predict_layers": 1 if mtp else 0,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        # q_lora_rank null -> plain q_proj (as DeepSeek-V2-Lite); MLA KV compression kept.
        "q_lora_rank": None,
        "kv_lora_rank": 64,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16,
        "v_head_dim": 32,
        # MoE only where the layer index >= first_k_dense_replace: the MTP layer, or none.
        "first_k_dense_replace": layers if moe_head else layers + 1,
        "moe_layer_freq": 1,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.0,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "torch_dtype": "float32",
        "use_cache": True,
    }


# --------------------------------------------------------------------------------------
# Training-time MTP head (DeepSeek-V3 layout)
# --------------------------------------------------------------------------------------


class SharedHeadNorm(nn.Module):
    """``shared_head``: its ``norm`` is the head's own; ``head`` is the main lm_head."""

    def __init__(self, dims: int, eps: float) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(dims, eps=eps)


class MTPHead(dsv3.DeepseekV3DecoderLayer):
    """One DeepSeek-V3 MTP module. Subclassing the decoder layer keeps its parameter names
    (``self_attn.*``, ``mlp.*``, ``input_layernorm``...) exactly those of a main layer."""

    def __init__(self, args: dsv3.ModelArgs) -> None:
        super().__init__(args, layer_idx=args.num_hidden_layers)
        dims = args.hidden_size
        self.enorm = nn.RMSNorm(dims, eps=args.rms_norm_eps)
        self.hnorm = nn.RMSNorm(dims, eps=args.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * dims, dims, bias=False)
        self.shared_head = SharedHeadNorm(dims, args.rms_norm_eps)

    def hidden(
        self, h: mx.array, tok_emb: mx.array, cache: Any = None, mask: mx.array | None = None
    ) -> mx.array:
        """Pre-norm output of the head for pairs (h_i, embed(t_{i+1}))."""
        x = self.eh_proj(mx.concatenate([self.enorm(tok_emb), self.hnorm(h)], axis=-1))
        if mask is None:
            mask = create_attention_mask(x, cache, return_array=True)
        return dsv3.DeepseekV3DecoderLayer.__call__(self, x, mask, cache)


def head_logits(head: MTPHead, main: dsv3.Model, x: mx.array) -> mx.array:
    return main.lm_head(head.shared_head.norm(x))


# --------------------------------------------------------------------------------------
# Qwen3.5 hybrid layout (--family qwen3_5)
# --------------------------------------------------------------------------------------


def qwen3_5_config(
    vocab_size: int,
    eos_id: int,
    *,
    layers: int = 8,
    hidden: int = 192,
    intermediate: int = 512,
    heads: int = 4,
    full_attention_interval: int = 4,
    mtp: bool = True,
) -> dict[str, Any]:
    """A Qwen3.5 config.json (``text_config`` inside, as the released checkpoints): every
    ``full_attention_interval``-th layer is full (gated) attention, the others GatedDeltaNet
    linear attention; ``mtp_num_hidden_layers`` advertises the head."""
    head_dim = 32
    text = {
        "model_type": "qwen3_5_text",
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "full_attention_interval": full_attention_interval,
        "layer_types": [
            "full_attention" if (i + 1) % full_attention_interval == 0 else "linear_attention"
            for i in range(layers)
        ],
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 2),
        "head_dim": head_dim,
        "linear_num_value_heads": heads,
        "linear_num_key_heads": max(1, heads // 2),
        "linear_key_head_dim": head_dim,
        "linear_value_head_dim": head_dim,
        "linear_conv_kernel_dim": 4,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab_size,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "attn_output_gate": True,
        "hidden_act": "silu",
        "mamba_ssm_dtype": "float32",
        "mtp_num_hidden_layers": 1 if mtp else 0,
        "mtp_use_dedicated_embeddings": False,
        "partial_rotary_factor": 0.25,
        # rotary dims = head_dim * 0.25 = 8 -> 4 frequencies, split t/h/w as released configs
        "rope_parameters": {
            "mrope_interleaved": True,
            "mrope_section": [2, 1, 1],
            "partial_rotary_factor": 0.25,
            "rope_theta": 10000000,
            "rope_type": "default",
        },
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "dtype": "float32",
    }
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "language_model_only": True,
        "tie_word_embeddings": False,
        "text_config": text,
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "torch_dtype": "float32",
    }


class _NormRef:
    """``head.shared_head.norm`` for the Qwen3.5 head (its final ``mtp.norm``), so the
    evaluation code below drives both families through one interface."""

    def __init__(self, norm: nn.Module) -> None:
        self.norm = norm


def qwen3_5_head(text: Any) -> Any:
    """The project's own Qwen3.5 head module (the inference forward), wired to ``text``'s
    embedding and lm_head, with the ``hidden`` / ``shared_head.norm`` interface of
    ``MTPHead`` above. Its parameters are the head's own only."""
    from melix_mlx.heads.qwen3_5 import MTPHead as Qwen3_5Head

    class TrainHead(Qwen3_5Head):
        @property
        def shared_head(self) -> _NormRef:
            return _NormRef(self.norm)

        def hidden(
            self, h: mx.array, tok_emb: mx.array, cache: Any = None, mask: mx.array | None = None
        ) -> mx.array:
            """Pre-norm output for pairs (h_i, embed(t_{i+1})): ``__call__`` minus the norm."""
            e = self.pre_fc_norm_embedding(tok_emb)
            x = self.fc(mx.concatenate([e, self.pre_fc_norm_hidden(h)], axis=-1))
            if mask is None:
                mask = create_attention_mask(x, cache)
            return self.layers[0](x, mask=mask, cache=cache)

    return TrainHead(text.args, text.model.embed_tokens, text.lm_head)


# HF stores these Qwen3.5 norms as w with forward (1 + w); mlx-lm adds the 1 when it
# sanitizes an HF checkpoint (recognised by its [C, 1, K] conv1d weights).
_Q35_MAIN_ONE_PLUS = (".input_layernorm.weight", ".post_attention_layernorm.weight",
                      "model.norm.weight", ".q_norm.weight", ".k_norm.weight")
_Q35_HEAD_ONE_PLUS = ("pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight", "norm.weight",
                      ".input_layernorm.weight", ".post_attention_layernorm.weight",
                      ".q_norm.weight", ".k_norm.weight")


def qwen3_5_main_to_hf(model: q35.Model) -> dict[str, mx.array]:
    """Inverse of qwen3_5 ``sanitize``: HF names, conv1d as [C, 1, K], (1+w) norms as w."""
    out: dict[str, mx.array] = {}
    for name, value in tree_flatten(model.parameters()):
        if name.startswith("language_model.model."):
            key = "model.language_model." + name[len("language_model.model."):]
        else:
            key = name[len("language_model."):]  # lm_head.weight
        if "conv1d.weight" in name:
            value = value.moveaxis(2, 1)
        elif value.ndim == 1 and name.endswith(_Q35_MAIN_ONE_PLUS):
            value = value - 1.0
        out[key] = value
    return out


def qwen3_5_head_to_hf(head: nn.Module) -> dict[str, mx.array]:
    """The head's own tensors under ``mtp.*``, (1+w) norms stored as w (inverse of the
    project's ``heads.qwen3_5.from_hf``)."""
    out: dict[str, mx.array] = {}
    for name, value in tree_flatten(head.parameters()):
        if value.ndim == 1 and name.endswith(_Q35_HEAD_ONE_PLUS) and "linear_attn" not in name:
            value = value - 1.0
        out[f"mtp.{name}"] = value
    return out


# --------------------------------------------------------------------------------------
# Hugging Face <-> mlx names
# --------------------------------------------------------------------------------------


def layer_to_hf(params: dict[str, mx.array], prefix: str, args: dsv3.ModelArgs) -> dict:
    """Inverse of deepseek_v3 sanitize for one layer's flat mlx params (names relative to
    the layer) -> HF names under ``prefix``."""
    out: dict[str, mx.array] = {}
    wk = params.get("self_attn.embed_q.weight")  # (heads, kv_lora, nope)
    wv = params.get("self_attn.unembed_out.weight")  # (heads, v_dim, kv_lora)
    for name, value in params.items():
        if name in ("self_attn.embed_q.weight", "self_attn.unembed_out.weight"):
            continue
        if name.startswith("mlp.switch_mlp."):
            proj = name.split(".")[2]  # gate_proj / up_proj / down_proj
            for e in range(value.shape[0]):
                out[f"{prefix}.mlp.experts.{e}.{proj}.weight"] = value[e]
            continue
        out[f"{prefix}.{name}"] = value
    if wk is not None and wv is not None:
        # HF kv_b_proj rows are per head [nope rows for K, v_dim rows for V].
        kv_b = mx.concatenate([wk.swapaxes(-1, -2), wv], axis=1)
        out[f"{prefix}.self_attn.kv_b_proj.weight"] = kv_b.reshape(-1, args.kv_lora_rank)
    return out


def layer_from_hf(weights: dict[str, mx.array], prefix: str, args: dsv3.ModelArgs) -> dict:
    """HF names under ``prefix`` -> flat mlx names relative to the layer (what sanitize does,
    applied to the MTP layer; used here only to verify the saved head round-trips)."""
    rel = {k[len(prefix) + 1 :]: v for k, v in weights.items() if k.startswith(prefix + ".")}
    out: dict[str, mx.array] = {}
    experts: dict[str, dict[int, mx.array]] = {}
    for name, value in rel.items():
        parts = name.split(".")
        if name.startswith("mlp.experts."):
            experts.setdefault(parts[3], {})[int(parts[2])] = value
        elif name == "self_attn.kv_b_proj.weight":
            nope = args.qk_nope_head_dim
            v = value.reshape(args.num_attention_heads, nope + args.v_head_dim, -1)
            out["self_attn.embed_q.weight"] = mx.contiguous(v[:, :nope, :].swapaxes(-1, -2))
            out["self_attn.unembed_out.weight"] = mx.contiguous(v[:, nope:, :])
        else:
            out[name] = value
    for proj, per_expert in experts.items():
        out[f"mlp.switch_mlp.{proj}.weight"] = mx.stack(
            [per_expert[e] for e in sorted(per_expert)]
        )
    return out


def main_to_hf(model: dsv3.Model) -> dict[str, mx.array]:
    flat = dict(tree_flatten(model.parameters()))
    out: dict[str, mx.array] = {}
    for i in range(model.args.num_hidden_layers):
        pre = f"model.layers.{i}."
        layer = {k[len(pre) :]: v for k, v in flat.items() if k.startswith(pre)}
        out.update(layer_to_hf(layer, pre[:-1], model.args))
    out.update({k: v for k, v in flat.items() if not k.startswith("model.layers.")})
    return out


def head_to_hf(head: MTPHead, main: dsv3.Model) -> dict[str, mx.array]:
    prefix = f"model.layers.{main.args.num_hidden_layers}"
    out = layer_to_hf(dict(tree_flatten(head.parameters())), prefix, main.args)
    # Shared tensors, stored again under the head as in deepseek-ai/DeepSeek-V3.
    out[f"{prefix}.embed_tokens.weight"] = main.model.embed_tokens.weight
    out[f"{prefix}.shared_head.head.weight"] = main.lm_head.weight
    return out


# --------------------------------------------------------------------------------------
# Data and tokenizer
# --------------------------------------------------------------------------------------


def stdlib_files() -> tuple[Path, list[Path], list[Path]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if not p.name.startswith("_sysconfigdata"))
    train = [p for i, p in enumerate(files) if i % EVAL_EVERY != EVAL_OFFSET]
    held = [p for i, p in enumerate(files) if i % EVAL_EVERY == EVAL_OFFSET]
    return root, train, held


def read_text(path: Path) -> str:
    return path.read_bytes().decode("utf-8", errors="replace")


def train_tokenizer(texts: list[str], vocab_size: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def tokenizer_config() -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 2048,
    }


def encode_stream(tok: Any, texts: list[str], eos_id: int) -> np.ndarray:
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos_id)  # a document boundary the model learns to see
    return np.asarray(ids, dtype=np.int32)


def sample_windows(stream: np.ndarray, rng: np.random.Generator, batch: int, length: int):
    starts = rng.integers(0, len(stream) - length - 1, size=batch)
    return np.stack([stream[s : s + length + 1] for s in starts])


def eval_windows(stream: np.ndarray, length: int, limit: int) -> np.ndarray:
    n = min(limit, (len(stream) - 1) // length)
    return np.stack([stream[i * length : i * length + length + 1] for i in range(n)])


# --------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------


def lr_schedule(peak: float, steps: int, warmup: int) -> Callable:
    warm = optim.linear_schedule(peak * 0.05, peak, warmup)
    decay = optim.cosine_decay(peak, max(1, steps - warmup), end=peak * 0.1)
    return optim.join_schedules([warm, decay], [warmup])


def train_main(
    model: dsv3.Model,
    train: np.ndarray,
    *,
    steps: int,
    batch: int,
    length: int,
    lr: float,
    rng: np.random.Generator,
    log: Callable[[str], None],
) -> list[tuple[int, float]]:
    opt = optim.AdamW(learning_rate=lr_schedule(lr, steps, max(1, min(100, steps // 10))),
                      weight_decay=0.01)

    def loss_fn(m: dsv3.Model, x: mx.array, y: mx.array) -> mx.array:
        return nn.losses.cross_entropy(m(x), y, reduction="mean")

    grad_fn = nn.value_and_grad(model, loss_fn)
    state = [model.state, opt.state]

    def step(x: mx.array, y: mx.array) -> mx.array:
        loss, grads = grad_fn(model, x, y)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        opt.update(model, grads)
        return loss

    step = mx.compile(step, inputs=state, outputs=state)
    curve: list[tuple[int, float]] = []
    t0, running = time.time(), 0.0
    for it in range(1, steps + 1):
        w = mx.array(sample_windows(train, rng, batch, length))
        loss = step(w[:, :-1], w[:, 1:])
        mx.eval(state, loss)
        running += loss.item()
        if it % 25 == 0 or it == steps:
            n = 25 if it % 25 == 0 else it % 25
            curve.append((it, round(running / n, 4)))
            log(f"main step {it}/{steps} loss {running / n:.3f} "
                f"({(time.time() - t0) / it * 1000:.0f} ms/step)")
            running = 0.0
    return curve


def decoder_chain(family: str) -> str:
    """The hidden the project's decoder chains at depth > 1 for ``family``: "post" (after
    the head's final norm) or "pre" (the head layer's output), from the head class itself."""
    from melix_mlx.heads import HEAD_CLASSES

    return "post" if HEAD_CLASSES[family].CHAIN_POST_NORM else "pre"


class _KeyTap:
    """A stand-in head cache for training's first draft step: RoPE offset 0, records the
    keys and values it is handed so the chained step can attend to them."""

    offset = 0

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.keys, self.values = keys, values
        return keys, values


class _ChainedCache:
    """The head cache as the decoder's second draft step sees it, for all positions at once:
    the chained entry for pair i sits at RoPE position i + 1 (offset 1 for a sequence
    starting at pair 0) and attends to the first step's entries 0..i plus itself
    (``chain_mask``)."""

    offset = 1

    def __init__(self, tap: _KeyTap) -> None:
        self.tap = tap

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        return (mx.concatenate([self.tap.keys, keys], axis=2),
                mx.concatenate([self.tap.values, values], axis=2))


def chain_mask(first: int, second: int) -> mx.array:
    """[second, first + second] boolean: chained query i sees first-step keys 0..i and its
    own key (first + i)."""
    rows = np.arange(second)[:, None]
    seen = np.concatenate([np.arange(first)[None, :] <= rows,
                           np.arange(second)[None, :] == rows], axis=1)
    return mx.array(seen)


def greedy_pool(
    main: Any, train: np.ndarray, *, size: int, length: int, prompt: int,
    rng: np.random.Generator, log: Callable[[str], None], chunk: int = 32,
) -> np.ndarray:
    """``size`` windows of ``length + 1`` tokens: a training-text prompt of ``prompt``
    tokens continued by the main model's own greedy tokens, the text a head drafts on
    at inference. Prompts come from the training files only."""
    rows = []
    for i in range(0, size, chunk):
        n = min(chunk, size - i)
        starts = rng.integers(0, len(train) - prompt, size=n)
        prompts = np.stack([train[s : s + prompt] for s in starts])
        seqs = greedy_continue(main, mx.array(prompts), length + 1 - prompt)
        rows.append(np.array(seqs[:, : length + 1]))
        log(f"greedy pool {i + n}/{size}")
    return np.concatenate(rows).astype(np.int32)


def train_head(
    head: MTPHead,
    main: dsv3.Model,
    train: np.ndarray,
    *,
    steps: int,
    batch: int,
    length: int,
    lr: float,
    target: str,
    bias_rate: float,
    rng: np.random.Generator,
    log: Callable[[str], None],
    chain_weight: float = 0.0,
    chain: str = "pre",
    pool: np.ndarray | None = None,
    pool_rows: int = 0,
) -> list[tuple[int, float]]:
    """Self-distillation: the frozen main model supplies h_i and the target at i+1.

    ``chain_weight > 0`` adds the second draft step as the decoder runs it: the head's own
    output for pair i (``chain`` "pre" or "post" its final norm) with token t_{i+2}, attending
    to the first step's entries 0..i, trained on the main model's argmax at i+2; the loss is
    step-1 loss + chain_weight * step-2 loss. ``pool_rows`` of each batch come from
    ``pool`` (the main model's greedy continuations), the rest from training text."""
    if chain_weight and target != "distill":
        raise SystemExit("--chain-loss-weight needs --head-target distill")
    main.freeze()
    mlp = getattr(head, "mlp", None)  # a DeepSeek-V3 head layer; Qwen3.5 nests its layer
    gate = mlp.gate if isinstance(mlp, dsv3.DeepseekV3MoE) else None
    if gate is not None:
        # Aux-loss-free balancing (DeepSeek-V3): the bias is moved by load, not by gradients.
        gate.freeze(keys=["e_score_correction_bias"])
    opt = optim.AdamW(learning_rate=lr_schedule(lr, steps, max(1, min(50, steps // 10))),
                      weight_decay=0.01)
    second_mask = chain_mask(length, length - 1)

    def layer(hd: MTPHead, h: mx.array, emb: mx.array, cache: Any, mask: mx.array | None):
        """The head's pre-norm output, and the routed MLP's input (DeepSeek-V3 MoE head:
        recomputed explicitly so the router's load is visible)."""
        if gate is None:
            return hd.hidden(h, emb, cache, mask), None
        x = hd.eh_proj(mx.concatenate([hd.enorm(emb), hd.hnorm(h)], axis=-1))
        if mask is None:
            mask = create_attention_mask(x, None, return_array=True)
        x = x + hd.self_attn(hd.input_layernorm(x), mask, cache)
        xn = hd.post_attention_layernorm(x)
        return x + hd.mlp(xn), xn

    def loss_fn(hd: MTPHead, w: mx.array) -> tuple[mx.array, mx.array]:
        h = mx.stop_gradient(main.model(w))  # post-norm hidden, (B, T, D)
        greedy = None
        if target == "distill":
            greedy = mx.stop_gradient(mx.argmax(main.lm_head(h), axis=-1))  # [j] -> t_{j+1}
            tgt = greedy[:, 1:]
        elif target == "soft":  # the main model's whole next-token distribution
            tgt = mx.stop_gradient(mx.softmax(main.lm_head(h[:, 1:]), axis=-1))
        else:
            tgt = w[:, 2:]
        tap = _KeyTap() if chain_weight else None
        x, xn = layer(hd, h[:, :-1], main.model.embed_tokens(w[:, 1:]), tap, None)
        logits = head_logits(hd, main, x)
        # Distillation has a target for all T pairs; the data token t_{i+2} for T-1.
        if target in ("distill", "soft"):
            loss = nn.losses.cross_entropy(logits, tgt, reduction="mean")
        else:
            loss = nn.losses.cross_entropy(logits[:, :-1], tgt, reduction="mean")
        if chain_weight:
            fed = hd.shared_head.norm(x) if chain == "post" else x
            x2, _ = layer(hd, fed[:, :-1], main.model.embed_tokens(w[:, 2:]),
                          _ChainedCache(tap), second_mask)
            loss2 = nn.losses.cross_entropy(head_logits(hd, main, x2), greedy[:, 2:],
                                            reduction="mean")
            loss = loss + chain_weight * loss2
        if gate is None:
            return loss, mx.zeros((1,))
        inds, _ = hd.mlp.gate(xn)
        load = (inds[..., None] == mx.arange(gate.n_routed_experts)).sum(axis=(0, 1, 2))
        return loss, load.astype(mx.float32)

    grad_fn = nn.value_and_grad(head, loss_fn)
    state = [head.state, opt.state]

    def step(w: mx.array) -> mx.array:
        (loss, load), grads = grad_fn(head, w)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        opt.update(head, grads)
        if gate is not None:
            gate.e_score_correction_bias = gate.e_score_correction_bias + bias_rate * mx.sign(
                load.mean() - load
            )
        return loss

    step = mx.compile(step, inputs=state, outputs=state)
    curve: list[tuple[int, float]] = []
    t0, running = time.time(), 0.0
    pool_rows = pool_rows if pool is not None else 0
    for it in range(1, steps + 1):
        rows = sample_windows(train, rng, batch - pool_rows, length)
        if pool_rows:
            rows = np.concatenate([rows, pool[rng.integers(0, len(pool), size=pool_rows)]])
        loss = step(mx.array(rows))
        mx.eval(state, loss)
        running += loss.item()
        if it % 25 == 0 or it == steps:
            n = 25 if it % 25 == 0 else it % 25
            curve.append((it, round(running / n, 4)))
            log(f"head step {it}/{steps} loss {running / n:.3f} "
                f"({(time.time() - t0) / it * 1000:.0f} ms/step)")
            running = 0.0
    main.unfreeze()
    return curve


# --------------------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------
# Saving and verification
# --------------------------------------------------------------------------------------


def save_checkpoint(
    out: Path,
    main: Any,
    head: Any | None,
    config: dict[str, Any],
    tok: Any,
    dtype: mx.Dtype,
    family: str = "deepseek_v3",
) -> dict[str, str]:
    """Write the checkpoint. ``main`` is the whole mlx-lm model (for qwen3_5 the outer
    ``Model``). DeepSeek-V3 keeps its head in ``mtp.safetensors`` (see the module doc);
    Qwen3.5 keeps ``mtp.*`` inside ``model.safetensors`` as the released checkpoints do
    (mlx-lm's qwen3_5 ``sanitize`` drops every ``mtp.`` key)."""
    out.mkdir(parents=True, exist_ok=True)
    meta = {"format": "pt"}  # what HF writers put; transformers checks for it

    def cast(d: dict[str, mx.array]) -> dict[str, mx.array]:
        # The router's correction bias and A_log stay float32, as mlx-lm's cast_predicate
        # keeps them.
        return {
            k: (v if "e_score_correction_bias" in k or k.endswith("A_log") else v.astype(dtype))
            for k, v in sorted(d.items())
        }

    if family == "qwen3_5":
        main_w = cast(qwen3_5_main_to_hf(main))
        head_w = cast(qwen3_5_head_to_hf(head)) if head is not None else {}
        head_file = "model.safetensors"
        main_w = {**main_w, **head_w}
    else:
        main_w = cast(main_to_hf(main))
        head_w = cast(head_to_hf(head, main)) if head is not None else {}
        head_file = "mtp.safetensors"
    mx.save_safetensors(str(out / "model.safetensors"), main_w, metadata=meta)
    stale = out / "mtp.safetensors"
    if head_w and head_file == "mtp.safetensors":
        mx.save_safetensors(str(stale), head_w, metadata=meta)
    elif stale.exists():  # a draft model written over a checkpoint that had a head
        stale.unlink()
    weight_map = {k: "model.safetensors" for k in main_w}
    weight_map.update({k: head_file for k in head_w})
    size = sum(v.nbytes for v in main_w.values())
    if head_file != "model.safetensors":
        size += sum(v.nbytes for v in head_w.values())
    index = {"metadata": {"total_size": size}, "weight_map": dict(sorted(weight_map.items()))}
    cfg = dict(config)
    cfg["torch_dtype"] = {mx.float32: "float32", mx.float16: "float16"}.get(dtype, "bfloat16")
    if "text_config" in cfg:
        cfg["text_config"] = {**cfg["text_config"], "dtype": cfg["torch_dtype"]}
    files = {
        "config.json": cfg,
        "model.safetensors.index.json": index,
        "tokenizer_config.json": tokenizer_config(),
        "special_tokens_map.json": {"bos_token": EOS, "eos_token": EOS, "pad_token": EOS},
        "generation_config.json": {"bos_token_id": cfg["bos_token_id"],
                                   "eos_token_id": cfg["eos_token_id"], "do_sample": False},
    }
    for name, obj in files.items():
        (out / name).write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
    tok.save(str(out / "tokenizer.json"))
    return {
        name: hashlib.sha256((out / name).read_bytes()).hexdigest()
        for name in ("model.safetensors", "mtp.safetensors", "tokenizer.json")
        if (out / name).exists()
    }


# Each layer's residual-branch outputs: zeroed, a layer adds nothing to its input.
_BRANCH_OUTPUTS = ("linear_attn.out_proj.weight", "self_attn.o_proj.weight", "mlp.down_proj.weight")


def grow_layers(new: list[nn.Module], old: list[nn.Module], interval: int) -> list[int]:
    """Depth growth: the ``old`` layers, block by block (``interval`` layers, the hybrid's
    period), are copied into evenly spread blocks of ``new``, in order; every other new layer
    has its residual-branch output projections zeroed, so the grown model computes exactly
    the old model's function before training. Returns the new index of each old layer."""
    if len(old) % interval or len(new) % interval or len(new) < len(old):
        raise SystemExit(f"--grow-from: {len(old)} -> {len(new)} layers is not whole blocks "
                         f"of {interval}")
    old_blocks, new_blocks = len(old) // interval, len(new) // interval
    placed = {b * new_blocks // old_blocks: b for b in range(old_blocks)}
    where: list[int] = []
    for nb in range(new_blocks):
        for j in range(interval):
            layer = new[nb * interval + j]
            if nb in placed:
                layer.update(old[placed[nb] * interval + j].parameters())
                where.append(nb * interval + j)
                continue
            flat = dict(tree_flatten(layer.parameters()))
            layer.load_weights([(k, mx.zeros_like(flat[k])) for k in _BRANCH_OUTPUTS if k in flat],
                               strict=False)
    return where


def stored_head(path: Path, family: str, args: Any) -> dict[str, mx.array]:
    """The head's own tensors of checkpoint ``path`` under the training head's names."""
    if family == "qwen3_5":
        from melix_mlx.heads.qwen3_5 import from_hf

        raw = mx.load(str(path / "model.safetensors"))
        return {k: v.astype(mx.float32) for k, v in from_hf(raw, {}).items()}
    prefix = f"model.layers.{args.num_hidden_layers}"
    weights = mx.load(str(path / "mtp.safetensors"))
    return {k: v.astype(mx.float32) for k, v in layer_from_hf(weights, prefix, args).items()
            if not k.startswith(("embed_tokens.", "shared_head.head."))}


def verify_checkpoint(
    out: Path, main: dsv3.Model, head: MTPHead | None, windows: np.ndarray
) -> dict[str, Any]:
    """mlx_lm.load the saved directory; compare main logits and (via our own inverse
    mapping) head logits with the in-memory models."""
    import mlx_lm

    loaded, tokenizer = mlx_lm.load(str(out))
    w = mx.array(windows[:4, :-1])
    ref = main(w)
    got = loaded(w).astype(mx.float32)
    main_diff = mx.abs(ref - got).max().item()
    same_argmax = (mx.argmax(ref, -1) == mx.argmax(got, -1)).mean().item()
    prompt = "import os\n\n\ndef "
    text = mlx_lm.generate(loaded, tokenizer, prompt, max_tokens=48, verbose=False)
    result: dict[str, Any] = {
        "mlx_lm_load": "ok",
        "main_logits_max_abs_diff": main_diff,
        "main_argmax_agreement": same_argmax,
    }
    if head is None:
        result["greedy_sample"] = {"prompt": prompt, "completion": text}
        return result
    if not hasattr(head, "eh_proj"):  # Qwen3.5: the project's loader reads the head back
        from melix_mlx.loading import load_with_heads

        model2, _, head2, info = load_with_heads(out)
        h = main.model(w)
        a = head(h[:, :-1], w[:, 1:])[0]
        b = head2(model2.language_model.model(w)[:, :-1], w[:, 1:])[0].astype(mx.float32)
        return {
            **result,
            "head_logits_max_abs_diff": mx.abs(a - b).max().item(),
            "head_argmax_agreement": (mx.argmax(a, -1) == mx.argmax(b, -1)).mean().item(),
            "load_with_heads": {"family": getattr(info, "family", None),
                                "norms_repaired_on_load": getattr(info, "norms_repaired_on_load",
                                                                  None)},
            "greedy_sample": {"prompt": prompt, "completion": text},
        }

    args = main.args
    weights = mx.load(str(out / "mtp.safetensors"))
    fresh = MTPHead(args)
    prefix = f"model.layers.{args.num_hidden_layers}"
    fresh.load_weights(
        [(k, v.astype(mx.float32)) for k, v in layer_from_hf(weights, prefix, args).items()
         if not k.startswith(("embed_tokens.", "shared_head.head."))],
        strict=True,
    )
    h = main.model(w)
    e = main.model.embed_tokens(w[:, 1:])
    a = head_logits(head, main, head.hidden(h[:, :-1], e))
    b = head_logits(fresh, main, fresh.hidden(h[:, :-1], e))
    head_diff = mx.abs(a - b).max().item()
    return {
        **result,
        "head_logits_max_abs_diff": head_diff,
        "head_tensors_shared_equal": bool(
            mx.array_equal(weights[f"{prefix}.shared_head.head.weight"],
                           loaded.lm_head.weight).item()
            and mx.array_equal(weights[f"{prefix}.embed_tokens.weight"],
                               loaded.model.embed_tokens.weight).item()
        ),
        "greedy_sample": {"prompt": prompt, "completion": text},
    }


# --------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--family", choices=["deepseek_v3", "qwen3_5"], default="deepseek_v3",
                    help="checkpoint layout: DeepSeek-V3 (MLA, eh_proj head) or the Qwen3.5 "
                         "hybrid (GatedDeltaNet + full attention, mtp.* head)")
    ap.add_argument("--full-attention-interval", type=int, default=4,
                    help="qwen3_5: every N-th layer is full attention, the rest linear")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=300, help="main-model optimizer steps")
    ap.add_argument("--head-steps", type=int, default=150)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--head-lr", type=float, default=5e-3)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--head-target", choices=["distill", "soft", "data"], default="distill")
    ap.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32")
    ap.add_argument("--eval-windows", type=int, default=64)
    ap.add_argument("--layers", type=int, default=8, help="main decoder layers")
    ap.add_argument("--hidden", type=int, default=192)
    ap.add_argument("--intermediate", type=int, default=512, help="dense MLP width")
    ap.add_argument("--heads", type=int, default=4, help="attention heads")
    ap.add_argument("--moe-head", action="store_true",
                    help="MoE MTP layer (first_k_dense_replace = layers); default dense")
    ap.add_argument("--moe-intermediate", type=int, default=None,
                    help="expert width for --moe-head (default: hidden)")
    ap.add_argument("--no-head", action="store_true",
                    help="train and save the main model only (a draft model)")
    ap.add_argument("--tokenizer-like", type=Path, default=None,
                    help="assert the written tokenizer files equal this checkpoint's")
    ap.add_argument("--init-from", type=Path, default=None,
                    help="continue training the main model from this checkpoint (same config; "
                         "its training_report.json command ran first); batches are drawn from "
                         "a different stream; the head is trained afresh unless --init-head")
    ap.add_argument("--grow-from", type=Path, default=None,
                    help="qwen3_5: start the main model from this shallower checkpoint (same "
                         "widths): its layers spread in order over the deeper stack, the new "
                         "layers' output projections zeroed (same function at step 0)")
    ap.add_argument("--init-head", action="store_true",
                    help="with --init-from: start the head from that checkpoint's head too "
                         "(with --steps 0 this retrains the head alone on the same main model)")
    ap.add_argument("--chain-loss-weight", type=float, default=0.0,
                    help="add the second draft step (the head chained on its own output, as "
                         "the decoder runs it) to the head loss with this weight")
    ap.add_argument("--head-pool-rows", type=int, default=0,
                    help="rows of each head batch drawn from the main model's own greedy "
                         "continuations of training-text prompts (the text heads draft on)")
    ap.add_argument("--greedy-pool", type=int, default=384,
                    help="size of that pool (windows of seq-len + 1 tokens)")
    ap.add_argument("--greedy-prompt", type=int, default=32,
                    help="training-text prompt tokens at the start of each pool window")
    ap.add_argument("--no-openblas", action="store_true")
    opts = ap.parse_args(argv)
    if opts.init_from is not None and opts.grow_from is not None:
        ap.error("--init-from and --grow-from exclude each other")
    if opts.grow_from is not None and opts.family != "qwen3_5":
        ap.error("--grow-from is implemented for --family qwen3_5")
    if opts.init_head and ((opts.init_from or opts.grow_from) is None or opts.no_head):
        ap.error("--init-head needs --init-from or --grow-from, and a head")
    if not 0 <= opts.head_pool_rows <= opts.batch:
        ap.error("--head-pool-rows must be within 0..--batch")
    _maybe_reexec_with_openblas([__file__, *argv], opts.no_openblas)
    # Single-threaded tokenizer training keeps merges independent of thread timing.
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    t_start = time.time()
    timings: dict[str, float] = {}

    def log(msg: str) -> None:
        print(f"[train {time.time() - t_start:6.1f}s] {msg}", flush=True)

    mx.random.seed(opts.seed)
    # A continuation (--init-from) draws other batches than the run it continues.
    rng = np.random.default_rng(
        [opts.seed, 1] if opts.init_from is not None
        else [opts.seed, 2] if opts.grow_from is not None else opts.seed)
    init_report = None
    start_dir = opts.init_from or opts.grow_from
    if start_dir is not None:
        init_report = json.loads((start_dir / "training_report.json").read_text())

    root, train_files, held_files = stdlib_files()
    train_texts = [read_text(p) for p in train_files]
    held_texts = [read_text(p) for p in held_files]
    log(f"stdlib {root}: {len(train_files)} train files "
        f"({sum(map(len, train_texts))} chars), {len(held_files)} held out")

    t = time.time()
    tok = train_tokenizer(train_texts, opts.vocab)
    eos_id = tok.token_to_id(EOS)
    train_ids = encode_stream(tok, train_texts, eos_id)
    held_ids = encode_stream(tok, held_texts, eos_id)
    timings["tokenizer_and_encode_s"] = round(time.time() - t, 2)
    log(f"tokenizer vocab {tok.get_vocab_size()}; {len(train_ids)} train tokens, "
        f"{len(held_ids)} held-out tokens")

    if opts.family == "qwen3_5":
        config = qwen3_5_config(
            tok.get_vocab_size(), eos_id, layers=opts.layers, hidden=opts.hidden,
            intermediate=opts.intermediate, heads=opts.heads,
            full_attention_interval=opts.full_attention_interval, mtp=not opts.no_head,
        )
        whole: Any = q35.Model(q35.ModelArgs.from_dict(config))
        main_model: Any = whole.language_model  # trained and evaluated; same arrays
        args = main_model.args
        head: Any = qwen3_5_head(main_model)
    else:
        config = model_config(
            tok.get_vocab_size(), eos_id, layers=opts.layers, hidden=opts.hidden,
            intermediate=opts.intermediate, heads=opts.heads, moe_head=opts.moe_head,
            moe_intermediate=opts.moe_intermediate, mtp=not opts.no_head,
        )
        args = dsv3.ModelArgs.from_dict(config)
        main_model = whole = dsv3.Model(args)
        # The head is always constructed (same mx.random draws as with a head, so the main
        # model's init does not depend on --no-head), but only trained and saved with a head.
        head = MTPHead(args)
    mx.eval(main_model.parameters(), head.parameters())
    n_main = sum(v.size for _, v in tree_flatten(main_model.parameters()))
    n_head = sum(v.size for _, v in tree_flatten(head.parameters()))
    if opts.no_head:
        head, n_head = None, 0
    if opts.init_from is not None:
        import mlx_lm

        prev = json.loads((opts.init_from / "config.json").read_text())
        prev, cur = prev.get("text_config", prev), config.get("text_config", config)
        shape = ("model_type", "num_hidden_layers", "hidden_size", "intermediate_size")
        if any(prev.get(k) != cur.get(k) for k in shape):
            raise SystemExit(f"--init-from {opts.init_from}: a different model shape")
        previous, _ = mlx_lm.load(str(opts.init_from))
        whole.update(previous.parameters())  # same class and config: the same tree
        mx.eval(whole.parameters())
        log(f"main model initialised from {opts.init_from}")
    grown_at: list[int] | None = None
    if opts.grow_from is not None:
        import mlx_lm

        prev = json.loads((opts.grow_from / "config.json").read_text())["text_config"]
        same = ("hidden_size", "intermediate_size", "num_attention_heads", "full_attention_interval")
        if any(prev.get(k) != config["text_config"].get(k) for k in same):
            raise SystemExit(f"--grow-from {opts.grow_from}: different widths or period")
        previous, _ = mlx_lm.load(str(opts.grow_from))
        old_text = previous.language_model
        grown_at = grow_layers(main_model.model.layers, old_text.model.layers,
                               opts.full_attention_interval)
        main_model.model.embed_tokens.update(old_text.model.embed_tokens.parameters())
        main_model.model.norm.update(old_text.model.norm.parameters())
        main_model.lm_head.update(old_text.lm_head.parameters())
        mx.eval(whole.parameters())
        log(f"main model grown from {opts.grow_from}: its layers at {grown_at}")
    if opts.init_head:
        head.load_weights(list(stored_head(start_dir, opts.family, args).items()), strict=True)
        mx.eval(head.parameters())
        log(f"head initialised from {start_dir}")
    log(f"main params {n_main}, head params {n_head} (+ shared embed/lm_head)")

    t = time.time()
    main_curve = train_main(main_model, train_ids, steps=opts.steps, batch=opts.batch,
                            length=opts.seq_len, lr=opts.lr, rng=rng, log=log)
    timings["main_train_s"] = round(time.time() - t, 2)

    eval_w = eval_windows(held_ids, opts.seq_len, opts.eval_windows)
    held_loss = eval_main_loss(main_model, eval_w)
    n_bytes = sum(len(s.encode()) for s in held_texts)
    log(f"held-out loss {held_loss:.3f} ({held_loss * len(held_ids) / n_bytes / math.log(2):.3f} "
        f"bits/byte estimate)")

    head_curve: list[tuple[int, float]] = []
    acceptance: dict[str, Any] | None = None
    chain = decoder_chain(opts.family)
    if head is not None:
        t = time.time()
        pool = None
        if opts.head_pool_rows:
            pool = greedy_pool(main_model, train_ids, size=opts.greedy_pool, length=opts.seq_len,
                               prompt=opts.greedy_prompt, rng=rng, log=log)
            timings["greedy_pool_s"] = round(time.time() - t, 2)
        head_curve = train_head(head, main_model, train_ids, steps=opts.head_steps,
                                batch=opts.batch, length=opts.seq_len, lr=opts.head_lr,
                                target=opts.head_target, bias_rate=1e-2, rng=rng, log=log,
                                chain_weight=opts.chain_loss_weight, chain=chain, pool=pool,
                                pool_rows=opts.head_pool_rows)
        timings["head_train_s"] = round(time.time() - t, 2)

        t = time.time()
        tf = eval_head_teacher_forced(head, main_model, eval_w)
        log(f"teacher-forced k=1 acceptance {tf['head_vs_main_argmax']:.3f}")
        # Prompts: the first 64 tokens of held-out windows; 64 greedy tokens each.
        prompts = eval_w[:32, :64]
        decode = {
            c: eval_head_decode(head, main_model, prompts, new_tokens=64, depth=3, chain=c)
            for c in ("post", "pre")
        }
        for c, r in decode.items():
            log(f"decode acceptance chain={c}: {r['all_first_k_accepted']}")
        best = max(decode, key=lambda c: sum(decode[c]["all_first_k_accepted"].values()))
        timings["eval_s"] = round(time.time() - t, 2)
        acceptance = {
            "teacher_forced_k1": tf,
            "greedy_decode": decode,
            "chain_hidden": best,
            "decoder_chain": chain,
            "chain_note": "depth>1 feeds the head's own output back as the hidden input "
                          "with its own drafted token; 'post' = after shared_head.norm, "
                          "'pre' = raw decoder-layer output",
        }

    dtype = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}[opts.dtype]
    hashes = save_checkpoint(opts.out, whole, head, config, tok, dtype, opts.family)
    if opts.tokenizer_like is not None:
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            mine, theirs = (opts.out / name).read_bytes(), (opts.tokenizer_like / name).read_bytes()
            if mine != theirs:
                raise SystemExit(f"{name} differs from {opts.tokenizer_like / name}")
        log(f"tokenizer files identical to {opts.tokenizer_like}")
    verify = verify_checkpoint(opts.out, main_model, head, eval_w)
    log(f"verify: {json.dumps({k: v for k, v in verify.items() if k != 'greedy_sample'})}")
    log(f"greedy sample: {verify['greedy_sample']['completion']!r}")
    timings["total_s"] = round(time.time() - t_start, 2)

    import mlx_lm
    import tokenizers

    report = {
        "checkpoint": opts.out.name,
        "command": "python scripts/train_checkpoint.py " + " ".join(argv),
        "init_from": None if init_report is None else {
            "path": str(start_dir),
            "grown": None if grown_at is None else {
                "old_layers_at": grown_at,
                "rule": "the old layers copied in order into these indices; the other layers "
                        "fresh with linear_attn.out_proj / self_attn.o_proj / mlp.down_proj "
                        "zeroed (the grown model equals the old one before training)"},
            "command": init_report["command"],
            "init_from": init_report.get("init_from"),
            "training": {k: init_report["training"][k]
                         for k in ("seed", "steps", "batch", "seq_len", "lr", "main_loss_curve")},
            "note": "the main model continued from (or grew from) this run's main model; "
                    "run its command first, then this one",
        },
        "data": {
            "source": "sysconfig.get_paths()['stdlib'] top-level *.py, sorted, "
                      "minus _sysconfigdata*",
            "stdlib_root": str(root),
            "held_out_rule": f"index % {EVAL_EVERY} == {EVAL_OFFSET}",
            "train_files": [p.name for p in train_files],
            "held_out_files": [p.name for p in held_files],
            "train_bytes": sum(len(s.encode()) for s in train_texts),
            "held_out_bytes": n_bytes,
            "train_tokens": int(len(train_ids)),
            "held_out_tokens": int(len(held_ids)),
            "corpus_sha256": hashlib.sha256(
                b"".join(p.name.encode() + p.read_bytes() for p in train_files + held_files)
            ).hexdigest(),
        },
        "tokenizer": {"type": "byte-level BPE (tokenizers)", "vocab_size": tok.get_vocab_size(),
                      "eos": EOS, "eos_id": eos_id},
        "model": {"params_main": n_main, "params_head_own": n_head, "config": config},
        "training": {
            "seed": opts.seed, "steps": opts.steps, "head_steps": opts.head_steps,
            "batch": opts.batch, "seq_len": opts.seq_len, "lr": opts.lr,
            "head_lr": opts.head_lr, "optimizer": "AdamW wd=0.01, clip 1.0, warmup+cosine",
            "main_loss_curve": main_curve, "head_loss_curve": head_curve,
            "held_out_main_loss": round(held_loss, 4),
            "head_target": opts.head_target if head is not None else None,
            "head_layer": None if head is None else ("moe" if opts.moe_head else "dense"),
            "head_moe_bias_balancing_rate": 1e-2 if head is not None and opts.moe_head else None,
            "head_init": "from --init-from's head" if opts.init_head else "fresh",
            "head_chain_loss": None if not opts.chain_loss_weight else {
                "weight": opts.chain_loss_weight, "chain": chain,
                "rule": "step-1 loss + weight * step-2 loss; step 2 = the head on its own "
                        "output for pair i and token t_{i+2}, attending to step-1 entries "
                        "0..i, target the main model's argmax at i+2"},
            "head_greedy_pool": None if not opts.head_pool_rows else {
                "rows_per_batch": opts.head_pool_rows, "windows": opts.greedy_pool,
                "prompt_tokens": opts.greedy_prompt,
                "rule": "training-text prompts continued by the main model's own greedy "
                        "tokens"},
        },
        "acceptance": acceptance,
        "layout": {
            "family": opts.family,
            "main": "model.safetensors (HF DeepSeek-V3 names)" if opts.family != "qwen3_5"
                    else "model.safetensors (HF Qwen3.5 names: model.language_model.*, "
                         "conv1d [C, 1, K], (1+w) norms stored as w)",
            "head": None if head is None else
                    f"mtp.safetensors, prefix model.layers.{args.num_hidden_layers}."
                    if opts.family != "qwen3_5" else
                    "model.safetensors, prefix mtp. ((1+w) norms stored as w)",
            "shared_copies": "embed_tokens and shared_head.head are stored under the head; "
                             "equal to model.embed_tokens and lm_head"
                             if opts.family != "qwen3_5" else
                             "none: the head uses the main embed_tokens and lm_head",
            "dtype": opts.dtype,
        },
        "verify": verify,
        "files_sha256": hashes,
        "timings": timings,
        "environment": {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "mlx": mx.__version__,
            "mlx_lm": mlx_lm.__version__,
            "tokenizers": tokenizers.__version__,
            "numpy": np.__version__,
            "blas": "openblas (LD_PRELOAD)" if "libopenblas" in os.environ.get(
                "LD_PRELOAD", "") else "mlx bundled reference BLAS",
            "cpu_count": os.cpu_count(),
        },
    }
    (opts.out / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    log(f"wrote {opts.out} in {timings['total_s']:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
