"""The public import path `melix_mlx.generate`: re-exports `melix_mlx.decoding.generate`."""

from .decoding.generate import (
    MTPDecoder,
    MTPGenerationResponse,
    SettingError,
    encode_prompt,
    make_decoder,
    mtp_generate_step,
    mtp_stream_generate,
)

__all__ = [
    "MTPDecoder",
    "MTPGenerationResponse",
    "SettingError",
    "encode_prompt",
    "make_decoder",
    "mtp_generate_step",
    "mtp_stream_generate",
]
