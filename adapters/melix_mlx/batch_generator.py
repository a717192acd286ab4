"""The public import path `melix_mlx.batch_generator`: re-exports `melix_mlx.decoding.batch_generator`."""

from .decoding.batch_generator import (
    OBJECTIVES,
    InsertRequest,
    MTPBatchGenerator,
    MTPResponse,
    RequestFailed,
    RowState,
)

__all__ = [
    "InsertRequest",
    "MTPBatchGenerator",
    "MTPResponse",
    "OBJECTIVES",
    "RequestFailed",
    "RowState",
]
