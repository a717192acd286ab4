"""Train ``stdlib-tiny`` (DeepSeek-V3) or ``stdlib-hybrid`` (Qwen3.5): a trained native MTP head.

The recipe behind ``scripts/train_checkpoint.py`` (a script, not library code).
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
trained by this recipe shares one ``tokenizer.json`` byte for byte; ``--tokenizer-like DIR``
asserts it against another checkpoint.

Rules this recipe keeps:

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
  ``melix_mlx.loading.heads.qwen3_5.MTPHead`` (``fc(cat[norm_e(emb), norm_h(h)])`` -> one
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

Modules, in the order a run uses them: ``data`` (corpus, tokenizer, windows),
``deepseek_v3`` and ``qwen3_5`` (each family's config, training head and Hugging Face
names), ``models`` (building them), ``growth`` (``--init-from``, ``--grow-from``,
``--init-head``), ``main_model`` and ``head`` (the two training loops; ``progress`` is their
loss curve), ``evaluation``, ``saving`` (write and load back), ``report``
(``training_report.json``), ``cli`` (the options and the run).
"""

from .cli import main
from .data import EOS, EVAL_EVERY, EVAL_OFFSET, encode_stream, eval_windows, read_text, stdlib_files
from .deepseek_v3 import MTPHead, head_logits, layer_from_hf, layer_to_hf, model_config
from .evaluation import eval_head_decode, eval_head_teacher_forced, greedy_continue
from .growth import grow_layers, stored_head
from .head import ChainedCache, KeyTap, chain_mask, decoder_chain, greedy_pool, train_head
from .main_model import train_main
from .qwen3_5 import qwen3_5_config, qwen3_5_head
from .saving import save_checkpoint, verify_checkpoint

__all__ = [
    "EOS", "EVAL_EVERY", "EVAL_OFFSET", "ChainedCache", "KeyTap", "MTPHead", "chain_mask",
    "decoder_chain", "encode_stream", "eval_head_decode", "eval_head_teacher_forced",
    "eval_windows", "greedy_continue", "greedy_pool", "grow_layers", "head_logits",
    "layer_from_hf", "layer_to_hf", "main", "model_config", "qwen3_5_config", "qwen3_5_head",
    "read_text", "save_checkpoint", "stdlib_files", "stored_head", "train_head", "train_main",
    "verify_checkpoint",
]
