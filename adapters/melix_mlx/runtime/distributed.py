"""MTP decoding under mx.distributed: sharded loading, head placement, rank agreement.

Rules of this module:
- The target model is sharded by mlx-lm's own code: `model.shard(group)` (tensor) or
  `model.model.pipeline(group)` (pipeline). A family or shape mlx-lm cannot shard over
  the group is refused BEFORE any weight is read, with the typed reason
  `unsupported_sharding` (`ShardingRefused`), on every rank alike (the check depends
  only on the config and the group size).
- Head placement. Tensor: the head's decoder layer is sharded by the same mlx-lm
  function as the family's layers (its lm_head/embedding are the main model's, already
  sharded or replicated); a head outside `_SHARDED_HEADS` is replicated. Pipeline:
  every rank ends mlx-lm's pipelined forward holding the final hidden state (an
  all_gather), so the head runs on every rank unsharded; the drafts that count are
  rank 0's (below), the others only keep their head caches in step.
- One decision, made on rank 0. Every token-valued result a rank could compute
  differently (drafts, accept counts, bonus tokens, sampled tokens) is replaced, inside
  the lazy graph, by rank 0's value: `all_sum` of the value on rank 0 and zeros
  elsewhere (`Agreement.tokens`). Measured decisions (calibration, the live policy,
  auto depth) are rank 0's through `calibrate.agree` and the controller's `agree` hook.
  So shapes never diverge and no rank waits on a collective the others skip.
- The group travels with the model (`group_of(model)`): the engine and the activation
  find it there, so a model sharded here can never run a cycle without agreement.
- Failures end every rank: an exception on one rank is re-raised as a typed
  `DistributedError`; its process exits, the ring backend tells its peers that the
  connection was lost, and they raise `PeerLost`. `run_ranks` turns both into one JSON
  line on stderr and exit status 4 (3 for `ShardingRefused`). A survivor blocked inside
  a collective is not always woken by the ring backend; `mlx.launch` stops every rank with
  SIGTERM once one exits, and no handler here catches it (a Python handler cannot run
  while the main thread is blocked in mlx, and would keep the process alive): the
  survivor then ends with status -15 instead of its typed line. `mlx.launch` itself exits
  0 whatever its ranks return; it logs each non-zero status.
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import io
import json
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from melix_fsm.errors import MelixError
from melix_fsm.reasons import RefusalReason

EXIT_REFUSED, EXIT_RANK_FAILED = 3, 4  # refused on every rank alike; a rank failed or ranks disagree
_GROUP_ATTR = "melix_group"


class Sharding(enum.StrEnum):
    tensor = "tensor"
    pipeline = "pipeline"


class DistributedError(MelixError):
    """Base of the failures of a sharded run; `reason` is machine-readable."""

    reason: str = "rank_failed"

    def __init__(self, message: str, *, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank

    def as_json(self) -> dict[str, Any]:
        return {"error": self.reason, "rank": self.rank, "message": str(self)}


class ShardingRefused(DistributedError):
    """mlx-lm cannot shard this model over this group (typed refusal)."""

    reason = RefusalReason.unsupported_sharding.value


class RankFailed(DistributedError):
    """This rank raised; its peers see the connection drop and end too."""

    reason = "rank_failed"


class PeerLost(DistributedError):
    """Another rank ended (failed or was stopped) while this one was running."""

    reason = "peer_lost"


class RanksDisagree(DistributedError):
    """The ranks' results differ (must never happen: every decision is rank 0's)."""

    reason = "ranks_disagree"


# -- what mlx-lm 0.32 can shard --------------------------------------------------------
# Per mlx-lm model type: the (text) config fields the group size must divide for
# mlx-lm's tensor sharding to be exact. A type absent here is refused for tensor
# sharding even when mlx-lm has a `shard` (fail closed: nobody checked its shapes).
_TENSOR_DIVISIBLE: dict[str, tuple[str, ...]] = {
    "deepseek_v3": ("num_attention_heads", "intermediate_size", "moe_intermediate_size"),
    "glm4_moe": ("num_attention_heads", "num_key_value_heads", "intermediate_size", "moe_intermediate_size"),
    "qwen3_5": ("num_attention_heads", "linear_num_key_heads", "linear_num_value_heads", "intermediate_size"),
    "qwen3_5_moe": (
        "num_attention_heads",
        "linear_num_key_heads",
        "linear_num_value_heads",
        "moe_intermediate_size",
        "shared_expert_intermediate_size",
    ),
}
# heads whose decoder layer is sharded with the family's own function (others replicate)
_SHARDED_HEADS = ("deepseek_v3", "qwen3_5", "qwen3_5_moe")


def refusal(
    config: dict[str, Any], sharding: Sharding, size: int, *, can_tensor: bool, can_pipeline: bool
) -> str | None:
    """Why mlx-lm cannot shard this checkpoint `sharding`-wise over `size` ranks (None: it can).

    can_tensor / can_pipeline: whether mlx-lm's model class has `shard` /
    `model.pipeline` (read from the lazily built model: no weight is read).
    """
    model_type = str(config.get("model_type"))
    text = config.get("text_config") or config
    if sharding is Sharding.pipeline:
        if not can_pipeline:
            return f"mlx-lm has no pipeline sharding for {model_type}"
        layers = int(text.get("num_hidden_layers", 0))
        return f"{layers} layers cannot be pipelined over {size} ranks" if layers < size else None
    fields = _TENSOR_DIVISIBLE.get(model_type)
    if not can_tensor:
        return f"mlx-lm has no tensor sharding for {model_type}"
    if fields is None:
        return f"tensor sharding of {model_type} is not checked by this project"
    tied = text.get("tie_word_embeddings") or config.get("tie_word_embeddings")
    if model_type.startswith("qwen3_5") and not tied:
        fields = (*fields, "vocab_size")  # its lm_head is vocabulary-sharded
    bad = [f"{name}={text[name]}" for name in fields if name in text and int(text[name]) % size]
    return f"{', '.join(bad)} not divisible by {size} ranks" if bad else None


# -- loading ---------------------------------------------------------------------------
def init_group() -> Any:
    """The process group of this launch (a group of one outside `mlx.launch`)."""
    return mx.distributed.init()


def group_of(model: nn.Module) -> Any:
    """The group a model was sharded over, or None (single process or a group of one)."""
    group = getattr(model, _GROUP_ATTR, None)
    return group if group is not None and group.size() > 1 else None


def load_sharded(
    path: str | Path, sharding: Sharding | str, group: Any = None, *, with_head: bool = True
) -> tuple[nn.Module, Any, Any, Any]:
    """Load `(model, tokenizer, head, info)` sharded over `group` (default: this launch's).

    Weights are read lazily and materialised after sharding, so each rank holds only its
    shard. Raises `ShardingRefused` before reading a tensor when mlx-lm cannot shard it.
    `with_head=False` loads the target alone (head and info are None).
    """
    from mlx_lm.utils import load_config, load_tokenizer

    from ..loading.loaders import load_main, load_with_heads

    sharding = Sharding(sharding)
    group = group if group is not None else init_group()
    path = Path(path)
    config = load_config(path)
    if with_head:
        model, tokenizer, head, info = load_with_heads(path, lazy=True)
    else:
        model, config = load_main(path, lazy=True)
        tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id", None))
        head = info = None
    if group.size() > 1:
        reason = refusal(
            config,
            sharding,
            group.size(),
            can_tensor=hasattr(model, "shard"),
            can_pipeline=hasattr(getattr(model, "model", None), "pipeline"),
        )
        if reason is not None:
            detail = f"{sharding.value} sharding over {group.size()} ranks: {reason}"
            raise ShardingRefused(detail, rank=group.rank())
    shard(model, head, sharding, group, model_type=str(config.get("model_type")))
    return model, tokenizer, head, info


def shard(model: nn.Module, head: Any, sharding: Sharding | str, group: Any, *, model_type: str) -> None:
    """Shard a lazily loaded model (and its head) in place with mlx-lm's sharding; evaluate."""
    sharding = Sharding(sharding)
    if group.size() > 1:
        if sharding is Sharding.tensor:
            model.shard(group)
            if head is not None and model_type in _SHARDED_HEADS:
                _shard_head(model, head, group, model_type)
        else:
            model.model.pipeline(group)
        if head is not None:
            _rewire_head(model, head)
    setattr(model, _GROUP_ATTR, group)
    mx.eval(model.parameters())
    if head is not None:
        mx.eval(head.parameters())
    if group.size() > 1:  # every rank has its shard before the first collective forward
        mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group, stream=mx.cpu))


def _shard_head(model: nn.Module, head: Any, group: Any, model_type: str) -> None:
    """Shard the head's decoder layer with the family's own mlx-lm `shard` function.

    The function walks a model's layers; it is given a view whose layers are the head's
    (and, for qwen3_5, a tied lm_head, so the shared lm_head is not sharded twice).
    """
    layers = list(getattr(head, "layers", None) or [head.block])
    if model_type.startswith("qwen3_5"):
        tied = SimpleNamespace(args=SimpleNamespace(tie_word_embeddings=True))
        view = SimpleNamespace(layers=layers, language_model=tied)
    else:
        view = SimpleNamespace(model=SimpleNamespace(layers=layers))
    type(model).shard(view, group)


def _rewire_head(model: nn.Module, head: Any) -> None:
    """Point the head at the model's (possibly replaced, vocabulary-sharded) lm_head."""
    from ..loading.heads._base import SharedRefs
    from .hidden import main_parts

    parts = main_parts(model)
    own = getattr(head, "own_lm_head", False)
    if not own:
        head._shared = SharedRefs(parts.embed_tokens, parts.lm_head)


# -- agreement -------------------------------------------------------------------------
class Agreement:
    """Rank 0's values on every rank (identity for a group of one)."""

    def __init__(self, group: Any, *, pipelined: bool = False) -> None:
        self.group = group
        self.rank0 = group.rank() == 0
        # In mlx-lm's pipeline a stage that receives its input never reads the tokens it
        # was given, so its recv does not depend on an agreement still pending in the same
        # graph, and may run first while the sending stage waits in that agreement: a
        # deadlock. Agreed tokens that feed a pipelined forward are evaluated before it.
        self.settle_inputs = pipelined

    def tokens(self, values: mx.array) -> mx.array:
        """Rank 0's integer array, lazily: one all_sum with zeros off rank 0."""
        as_int = values.astype(mx.int32)
        # off rank 0: zeros that still DEPEND on the local value, so every rank reaches
        # this all_sum after the same collectives (a free-standing zeros array could be
        # scheduled before the forward's own all-reduces and deadlock the group)
        mine = as_int * (1 if self.rank0 else 0)  # the same graph on every rank
        return mx.distributed.all_sum(mine, group=self.group).astype(values.dtype)

    def check(self, payload: bytes) -> None:
        """Raise `RanksDisagree` on every rank unless every rank's payload equals rank 0's."""
        digest = hashlib.sha256(payload).digest()[:6]
        own = mx.array([digest[i] * 256 + digest[i + 1] for i in (0, 2, 4)], dtype=mx.float32)
        theirs = mx.distributed.all_sum(own if self.rank0 else mx.zeros_like(own), group=self.group)
        differs = mx.array([0.0 if bool(mx.all(own == theirs).item()) else 1.0])
        if mx.distributed.all_sum(differs, group=self.group).item() > 0:
            raise RanksDisagree("ranks produced different results", rank=self.group.rank())


def agreement(model: nn.Module) -> Agreement | None:
    group = group_of(model)
    if group is None:
        return None
    return Agreement(group, pipelined=getattr(getattr(model, "model", None), "pipeline_size", 1) > 1)


# -- running a command on every rank ---------------------------------------------------
def rank_error(exc: BaseException, rank: int | None = None, context: str = "") -> DistributedError:
    """The typed form of an exception on a rank: `PeerLost` when the backend lost a peer."""
    if isinstance(exc, DistributedError):
        exc.rank = rank if exc.rank is None else exc.rank
        return exc
    text = f"{context}{type(exc).__name__}: {exc}"
    if isinstance(exc, RuntimeError) and ("[ring]" in str(exc) or "peer" in str(exc)):
        return PeerLost(text, rank=rank)
    return RankFailed(text, rank=rank)


def run_ranks(body: Callable[[], int], *, json_output: bool, sharding: Sharding | str) -> int:
    """Run a command body on every rank: rank 0 prints, all ranks agree, failures are typed.

    Every rank's stdout is captured. The ranks then check that their outputs agree
    (the JSON lines' tokens, text and receipt; timings excluded); rank 0 prints its
    output, each JSON line gaining `distributed` (ranks, agreed). An exception on any
    rank becomes a `DistributedError`: one JSON line on stderr and exit status 4.
    """
    group = init_group()
    rank = group.rank()
    if group.size() == 1:
        return body()
    buffer = io.StringIO()
    try:
        with contextlib.redirect_stdout(buffer):
            status = body()
            Agreement(group).check(_comparable(buffer.getvalue(), json_output, status))
    except Exception as exc:  # every failure ends this rank, typed; its peers follow
        error = rank_error(exc, rank)
        print(json.dumps(error.as_json()), file=sys.stderr, flush=True)
        if rank == 0 and json_output:
            print(json.dumps(error.as_json()), flush=True)
        return EXIT_REFUSED if isinstance(error, ShardingRefused) else EXIT_RANK_FAILED
    if rank == 0:
        note = {"ranks": group.size(), "sharding": Sharding(sharding).value, "agreed": True}
        sys.stdout.write(_annotated(buffer.getvalue(), json_output, note))
        sys.stdout.flush()
    return status


def _comparable(output: str, json_output: bool, status: int) -> bytes:
    """What must be equal across ranks: status, tokens, text, finish reason, receipt."""
    if not json_output:
        return f"{status}\n{output}".encode()
    keep = ("index", "tokens", "text", "finish_reason", "receipt", "error", "depth")
    rows = []
    for line in output.splitlines():
        data = json.loads(line)
        rows.append({k: data.get(k) for k in keep})
    return json.dumps([status, rows], sort_keys=True).encode()


def _annotated(output: str, json_output: bool, note: dict[str, Any]) -> str:
    if not json_output:
        return output
    lines = []
    for line in output.splitlines():
        data = json.loads(line)
        data["distributed"] = note
        lines.append(json.dumps(data))
    return "".join(line + "\n" for line in lines)
