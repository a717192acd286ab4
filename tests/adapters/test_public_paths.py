"""The import paths people embed keep working after the layout moved into wings.

`melix_mlx.generate`, `melix_mlx.batch_generator` and `melix_mlx.decode` re-export the
decoding wing's modules (the same objects, not copies); `melix_mlx.loading` is the loading
wing itself and re-exports its loaders.
"""

from __future__ import annotations

import importlib

import pytest

PUBLIC = {
    "melix_mlx.generate": ("melix_mlx.decoding.generate", ["mtp_stream_generate", "mtp_generate_step"]),
    "melix_mlx.batch_generator": ("melix_mlx.decoding.batch_generator", ["MTPBatchGenerator", "MTPResponse"]),
    "melix_mlx.decode": ("melix_mlx.decoding.decode", ["MTPDecoder"]),
    "melix_mlx.loading": ("melix_mlx.loading.loaders", ["load_with_heads", "load_main", "HeadInfo"]),
}


@pytest.mark.parametrize("public", sorted(PUBLIC))
def test_a_public_path_re_exports_the_same_objects(public: str) -> None:
    home, names = PUBLIC[public]
    shown, origin = importlib.import_module(public), importlib.import_module(home)
    for name in names:
        assert getattr(shown, name) is getattr(origin, name)
    # everything the public path exports is its home's own public surface
    assert set(shown.__all__) <= {n for n in dir(origin) if not n.startswith("_")}
