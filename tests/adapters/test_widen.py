"""`melix-fsm widen`: a widened trained checkpoint computes its source's function.

On small widenings of both embedded layouts (stdlib-tiny: DeepSeek-V3 MLA; stdlib-hybrid:
Qwen3.5 GatedDeltaNet + attention), mlx-lm loads the result, the logits equal the
source's within float32 summation-order noise (atol 1e-3 on logits of magnitude ~10-20;
observed ~1e-5), mlx-lm's greedy text is identical, and the project's MTP decoder emits
the same tokens with the same accepted / rejected counts, greedy and sampled (one seed
draws the same tokens on both). The residual stream's new dims
are exactly zero and its old dims are the source's times sqrt(D'/D) (the norm rule).
The new input-side weights are random (not zero), the output is deterministic in the
seed, and bad sizes are typed errors (the CLI exits 2 with one line). A slow-marked test
checks greedy identity on the realistic presets.
"""

from __future__ import annotations

import hashlib
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")
mlx_lm = pytest.importorskip("mlx_lm")

from melix_mlx.loading.checkpoints import EMBEDDED  # noqa: E402
from melix_mlx.tools.widen import Sizes, WidenError  # noqa: E402
from melix_mlx.tools.widen_io import widen_checkpoint  # noqa: E402

LOGIT_ATOL = 1e-3
PROMPTS = [
    "def parse_args(argv=None):\n    parser = argparse.ArgumentParser(",
    "class Cache:\n    def __init__(self, maxsize=128):\n        self.",
    "for i, line in enumerate(lines):\n    if line.startswith('#'):\n        ",
]
# name -> (source, sizes): x2 with scaled heads, and a fractional widening whose head
# groups grow (query heads per key head 2 -> 4), so the head permutation is exercised.
VARIANTS = {
    "hybrid-x2": ("stdlib-hybrid", Sizes(hidden=256)),
    "hybrid-groups": (
        "stdlib-hybrid",
        Sizes(hidden=200, heads=16, kv_heads=4, linear_key_heads=2, linear_value_heads=8, intermediate=400),
    ),
    "tiny-x2": ("stdlib-tiny", Sizes(hidden=192)),
    "tiny-frac": ("stdlib-tiny", Sizes(hidden=160, heads=4)),
}


def _present(name: str) -> Path:
    path = EMBEDDED[name]
    if not (path / "config.json").is_file():
        pytest.skip(f"no embedded {name}")
    return path


@pytest.fixture(scope="module")
def widened(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("widen")
    built: dict[str, Path] = {}

    def get(variant: str) -> tuple[Path, Path]:
        source, sizes = VARIANTS[variant]
        src = _present(source)
        if variant not in built:
            built[variant] = root / variant
            widen_checkpoint(src, built[variant], sizes, seed=0)
        return src, built[variant]

    return get


@pytest.fixture(scope="module")
def loaded():
    from melix_mlx.loading import load_with_heads

    cache: dict[Path, tuple] = {}

    def get(path: Path) -> tuple:
        if path not in cache:
            cache[path] = load_with_heads(path)
        return cache[path]

    return get


def _ids(tokenizer, prompt: str) -> list[int]:
    return tokenizer.encode(prompt)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_mlx_lm_loads_it_and_the_logits_are_the_sources(variant: str, widened) -> None:
    src, dst = widened(variant)
    a, tok = mlx_lm.load(str(src))
    b, _ = mlx_lm.load(str(dst))  # strict load: every tensor named and shaped as mlx-lm expects
    cfg = json.loads((dst / "config.json").read_text())
    assert cfg.get("text_config", cfg)["hidden_size"] == VARIANTS[variant][1].hidden
    for prompt in PROMPTS:
        x = mx.array([_ids(tok, prompt)])
        la, lb = a(x), b(x)
        diff = mx.abs(la - lb).max().item()
        assert diff <= LOGIT_ATOL, (variant, diff)
        assert mx.array_equal(mx.argmax(la, axis=-1), mx.argmax(lb, axis=-1)).item()


@pytest.mark.parametrize("source", ["stdlib-hybrid", "stdlib-tiny"])
def test_norms_stay_exact_with_a_large_eps(source: str, tmp_path: Path) -> None:
    """With rms_norm_eps 0.5 the eps handling shows: rescaling only the norm weights (or
    scaling eps, which the per-head norms share) moves the logits far beyond the atol."""
    src = tmp_path / "src"
    src.mkdir()
    for f in _present(source).iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((src / "config.json").read_text())
    cfg.get("text_config", cfg)["rms_norm_eps"] = 0.5
    (src / "config.json").write_text(json.dumps(cfg))
    widen_checkpoint(src, tmp_path / "dst", Sizes(hidden=2 * cfg.get("text_config", cfg)["hidden_size"]))
    a, tok = mlx_lm.load(str(src))
    b, _ = mlx_lm.load(str(tmp_path / "dst"))
    x = mx.array([_ids(tok, PROMPTS[1])])
    assert mx.abs(a(x) - b(x)).max().item() <= LOGIT_ATOL


@pytest.mark.parametrize("variant", ["hybrid-x2", "tiny-x2"])
def test_residual_stream_new_dims_are_zero_and_old_dims_scaled(variant: str, widened) -> None:
    from melix_mlx.runtime.hidden import main_parts

    src, dst = widened(variant)
    a, tok = mlx_lm.load(str(src))
    b, _ = mlx_lm.load(str(dst))
    x = mx.array([_ids(tok, PROMPTS[0])])
    ha, hb = main_parts(a).inner(x), main_parts(b).inner(x)  # post final norm
    d, d2 = ha.shape[-1], hb.shape[-1]
    assert d2 == 2 * d
    assert mx.all(hb[..., d:] == 0).item()  # exactly zero, not merely small
    scale = math.sqrt(d2 / d)
    assert mx.allclose(hb[..., :d], scale * ha, atol=1e-4, rtol=1e-4).item()


@pytest.mark.parametrize("variant", ["hybrid-x2", "tiny-x2"])
def test_greedy_text_through_mlx_lm_generate_is_identical(variant: str, widened) -> None:
    src, dst = widened(variant)
    a, tok = mlx_lm.load(str(src))
    b, _ = mlx_lm.load(str(dst))
    for prompt in PROMPTS[:2]:
        want = mlx_lm.generate(a, tok, prompt, max_tokens=32, verbose=False)
        got = mlx_lm.generate(b, tok, prompt, max_tokens=32, verbose=False)
        assert got == want, (variant, prompt)
        assert len(tok.encode(want)) >= 16  # real text, not an early stop


@pytest.mark.parametrize(
    ("variant", "k"), [("hybrid-x2", 2), ("tiny-x2", 2), ("hybrid-groups", 1), ("tiny-frac", 1)]
)
def test_mtp_decode_tokens_and_acceptance_are_identical(variant: str, k: int, widened, loaded) -> None:
    from decode_refs import mtp, reference

    src, dst = widened(variant)
    model_a, tok, head_a, info_a = loaded(src)
    model_b, _, head_b, info_b = loaded(dst)
    assert info_a.family == info_b.family
    accepted = rejected = 0
    for prompt in PROMPTS:
        ids = _ids(tok, prompt)
        tokens_a, dec_a = mtp(model_a, head_a, ids, 32, k)
        tokens_b, dec_b = mtp(model_b, head_b, ids, 32, k)
        assert tokens_b == tokens_a == reference(model_b, ids, 32), (variant, k)
        sa, sb = dec_a.stats, dec_b.stats
        assert (sb["accepted"], sb["rejected"]) == (sa["accepted"], sa["rejected"]), (variant, k, sa, sb)
        assert sb["faults"] == 0 and sb["refusal"] is None
        accepted += sb["accepted"]
        rejected += sb["rejected"]
    assert accepted > 0 and rejected > 0  # real acceptance and real rollbacks on both sides


@pytest.mark.parametrize("variant", ["hybrid-x2", "tiny-x2"])
def test_sampled_mtp_decode_is_the_sources_draw_for_draw(variant: str, widened, loaded) -> None:
    """Sampled speculation (T = 0.7, k = 2) from one seed draws the same tokens and keeps
    the same drafts on the widened model as on its source: the same target and head
    distributions through the same acceptance rule, so what the sampling tests prove of
    the rule holds here, and a bench's sampled cells at size measure the trained model."""
    from decode_refs import mtp
    from melix_mlx.runtime.sampling import make_sampler

    src, dst = widened(variant)
    model_a, tok, head_a, _ = loaded(src)
    model_b, _, head_b, _ = loaded(dst)
    accepted = rejected = 0
    for seed, prompt in enumerate(PROMPTS):
        ids = _ids(tok, prompt)
        runs = []
        for model, head in ((model_a, head_a), (model_b, head_b)):
            mx.random.seed(seed)
            tokens, decoder = mtp(model, head, ids, 32, 2, sampler=make_sampler(temp=0.7))
            runs.append((tokens, decoder.stats["accepted"], decoder.stats["rejected"]))
        assert runs[1] == runs[0], (variant, prompt)
        accepted += runs[1][1]
        rejected += runs[1][2]
    assert accepted > 0 and rejected > 0  # drafts kept and drafts resampled on both sides


def test_new_weights_are_random_inputs_and_zero_outputs(widened) -> None:
    _, dst = widened("hybrid-x2")
    w = mx.load(str(dst / "model.safetensors"))
    p = "model.language_model.layers.0."
    up = np.array(w[p + "mlp.up_proj.weight"])
    down = np.array(w[p + "mlp.down_proj.weight"])
    assert up.shape == (640, 256) and down.shape == (256, 640)
    assert np.count_nonzero(up[320:]) == up[320:].size  # new units read the stream
    assert not down[:, 320:].any() and not down[128:].any()  # ... and write nothing
    emb = np.array(w["model.language_model.embed_tokens.weight"])
    assert not emb[:, 128:].any()
    # Qwen3.5 stores (1+w) norms as w: the new dims store -1 (effective weight 0)
    norm = np.array(w[p + "input_layernorm.weight"])
    assert np.all(norm[128:] == -1.0)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(w)
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in w.values())


def _digest(path: Path) -> str:
    return hashlib.sha256(b"".join(f.read_bytes() for f in sorted(path.glob("*.safetensors")))).hexdigest()


def test_deterministic_in_the_seed(tmp_path: Path) -> None:
    src = _present("stdlib-tiny")
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        widen_checkpoint(src, tmp_path / name, Sizes(hidden=128), seed=seed)
    assert _digest(tmp_path / "a") == _digest(tmp_path / "b") != _digest(tmp_path / "c")
    for name in ("tokenizer.json", "training_report.json"):
        assert (tmp_path / "a" / name).read_bytes() == (src / name).read_bytes()
    assert (tmp_path / "a" / "mtp.safetensors").is_file()  # the sidecar layout is kept


@pytest.mark.parametrize(
    ("source", "sizes", "match"),
    [
        ("stdlib-hybrid", Sizes(hidden=64), "smaller than the source's hidden size"),
        ("stdlib-hybrid", Sizes(hidden=256, heads=6), "multiple"),
        ("stdlib-hybrid", Sizes(hidden=256, kv_heads=1), "smaller than the source's"),
        ("stdlib-tiny", Sizes(hidden=192, heads=2), "smaller than the source's"),
    ],
)
def test_bad_sizes_are_typed_errors(source: str, sizes: Sizes, match: str, tmp_path: Path) -> None:
    with pytest.raises(WidenError, match=match):
        widen_checkpoint(_present(source), tmp_path / "out", sizes)
    assert not (tmp_path / "out").exists()


def test_unsupported_layouts_fail_closed(tmp_path: Path) -> None:
    src = _present("stdlib-tiny")
    for change, match in (
        ({"tie_word_embeddings": True}, "tied"),
        ({"first_k_dense_replace": 3}, "MoE"),
        ({"model_type": "llama"}, "model_type"),
    ):
        bad = tmp_path / "bad"
        bad.mkdir(exist_ok=True)
        for f in src.iterdir():
            (bad / f.name).write_bytes(f.read_bytes())
        cfg = json.loads((src / "config.json").read_text())
        (bad / "config.json").write_text(json.dumps({**cfg, **change}))
        with pytest.raises(WidenError, match=match):
            widen_checkpoint(bad, tmp_path / "out", Sizes(hidden=192))


def test_cli_exits_2_with_one_line(tmp_path: Path) -> None:
    _present("stdlib-hybrid")
    out = str(tmp_path / "o")
    cmd = [sys.executable, "-m", "melix_fsm.cli", "widen", "stdlib-hybrid", out, "--hidden", "64"]
    bad = subprocess.run(cmd, capture_output=True, text=True)
    assert bad.returncode == 2
    assert bad.stderr.strip().count("\n") == 0 and "Traceback" not in bad.stderr
    assert "smaller than the source's hidden size 128" in bad.stderr
    good = subprocess.run(cmd[:-1] + ["160"], capture_output=True, text=True)
    assert good.returncode == 0, good.stderr
    assert good.stdout.startswith(out) and good.stderr == ""  # no TTY: no bar


def test_preset_alias_is_widened_once_into_the_cache(tmp_path: Path, monkeypatch) -> None:
    from melix_mlx.loading.checkpoints import resolve_model
    from melix_mlx.tools import widen_presets

    _present("stdlib-tiny")
    monkeypatch.setenv("MELIX_FSM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(widen_presets.PRESETS, "stdlib-tiny-wide", ("stdlib-tiny", Sizes(hidden=128)))
    path = resolve_model("stdlib-tiny-wide")
    assert path == tmp_path / "cache" / "stdlib-tiny-wide"
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert resolve_model("stdlib-tiny-wide") == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp  # not widened again
    monkeypatch.setitem(widen_presets.PRESETS, "stdlib-tiny-wide", ("stdlib-tiny", Sizes(hidden=160)))
    assert json.loads((resolve_model("stdlib-tiny-wide") / "config.json").read_text())["hidden_size"] == 160


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["stdlib-hybrid-wide", "stdlib-tiny-wide"])
def test_realistic_presets_keep_greedy_tokens(preset: str, tmp_path_factory) -> None:
    """The realistic sizes (~1-1.4 GB float32): mlx-lm's greedy tokens equal the source's,
    and the MTP decoder's equal mlx-lm's on the widened model (MELIX_FSM_CACHE is used
    when set, so a prepared cache is not widened again)."""
    from decode_refs import mtp, reference
    from melix_mlx.loading import load_with_heads
    from melix_mlx.loading.checkpoints import resolve_model
    from melix_mlx.tools.widen_presets import PRESETS

    src = _present(PRESETS[preset][0])
    model_a, tok, _, _ = load_with_heads(src)
    model_b, _, head_b, _ = load_with_heads(resolve_model(preset))
    for prompt in PROMPTS[:2]:
        ids = _ids(tok, prompt)
        want = reference(model_a, ids, 32)
        assert reference(model_b, ids, 32) == want
        got, decoder = mtp(model_b, head_b, ids, 32, 2)
        assert got == want and decoder.stats["accepted"] > 0
