"""CLI/API parity: walk the `receipt`, `generate` and `serve` parsers and the API signatures.

- Every `melix-fsm receipt` option is accepted by `generate` and by `serve` with the same
  destination, choices, type and action (the receipt's positional MODEL_DIR is generate's --model;
  `--schema` prints the schema and is no start setting).
- Every setting maps onto an API keyword: speculative settings onto
  `speculative_config`, serving facts onto `ServingContext`, decode options onto
  `mtp_stream_generate` and mlx-lm's own `stream_generate` / `generate_step`.
- The receipt `generate --json` reports equals the one `melix-fsm receipt` prints and the
  one the API resolves, for the same settings.
"""

from __future__ import annotations

import argparse
import inspect
import json
from pathlib import Path

import pytest
from melix_mlx.generate import mtp_stream_generate
from melix_mlx.loading import load_with_heads
from mlx_lm.generate import generate_step, stream_generate

from melix_fsm.cli import build_parser, main
from melix_fsm.config import speculative_config
from melix_fsm.receipt import ServingContext, receipt_json, resolve

RECEIPT_ONLY = {"--schema"}  # an action, not a start setting
SPECULATIVE = {"method", "num_draft_tokens", "draft_model", "device_policy", "profile"}
SERVING = {"quantized_kv", "chunked_prefill", "batched"}
KV = {"kv_bits", "kv_group_size", "quantized_kv_start"}  # mlx-lm's own names
DECODE = KV | {"max_kv_size", "prefill_step_size", "max_tokens"}
SAMPLING = {"temp", "top_p", "seed"}  # make_sampler / mx.random.seed, as mlx-lm's CLI
DISTRIBUTED = {"sharding"}  # melix_mlx.runtime.distributed.load_sharded(model_dir, sharding, ...)
CLI_ONLY = {"help", "model", "prompt", "prompts_file", "json", "receipt", "stagger", "run"}
LOADING = {"mtp_sidecar": "sidecar"}  # CLI dest -> load_with_heads keyword
VISION = {"vision": "load_vlm", "image": "prepare"}  # CLI dest -> melix_mlx.vlm's call (extra vlm)


def _subparser(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {s: a for a in parser._actions for s in a.option_strings}


def test_every_receipt_option_is_a_generate_option() -> None:
    receipt, generate = _options(_subparser("receipt")), _options(_subparser("generate"))
    missing = sorted(set(receipt) - set(generate) - RECEIPT_ONLY - {"-h", "--help"})
    assert not missing, f"generate lacks receipt options {missing}"
    for flag, action in receipt.items():
        if flag in RECEIPT_ONLY or flag in ("-h", "--help"):
            continue
        twin = generate[flag]
        assert (twin.dest, twin.choices, twin.type, type(twin), twin.default) == (
            action.dest, action.choices, action.type, type(action), action.default
        ), flag


def test_every_setting_has_an_api_keyword() -> None:
    dests = {a.dest for name in ("generate", "receipt") for a in _subparser(name)._actions}
    dests -= {"model_dir", "schema", *VISION}
    unmapped = dests - SPECULATIVE - SERVING - DECODE - SAMPLING - DISTRIBUTED - CLI_ONLY - set(LOADING)
    assert not unmapped, f"options with no API keyword in this test's map: {unmapped}"
    assert set(inspect.signature(load_with_heads).parameters) >= set(LOADING.values())
    import melix_mlx.vlm as vlm  # importable without mlx-vlm (it loads inside load_vlm)

    assert all(callable(getattr(vlm, name)) for name in VISION.values())
    assert "images" in inspect.signature(vlm.prepare).parameters
    from melix_mlx.runtime.distributed import load_sharded

    assert set(inspect.signature(load_sharded).parameters) >= DISTRIBUTED
    config_kw = set(inspect.signature(speculative_config).parameters)
    assert config_kw >= SPECULATIVE
    assert set(ServingContext.__struct_fields__) >= SERVING
    ours = set(inspect.signature(mtp_stream_generate).parameters)
    assert ours >= DECODE
    theirs = set(inspect.signature(generate_step).parameters)
    assert KV | {"max_kv_size", "prefill_step_size", "max_tokens"} <= theirs  # mlx-lm's names
    assert "max_tokens" in inspect.signature(stream_generate).parameters  # the rest it hands on


@pytest.mark.parametrize(
    "flags",
    [
        ["--device-policy", "force_off", "--num-draft-tokens", "2"],
        ["--method", "none", "--chunked-prefill"],
        ["--quantized-kv", "--kv-group-size", "32", "--device-policy", "force_off"],
        ["--method", "draft_model", "--draft-model", "DRAFT", "--device-policy", "force_off"],
    ],
)
def test_generate_receipt_equals_receipt_command_and_api(tiny_checkpoint, flags, capsys) -> None:
    from melix_mlx.loading.checkpoints import resolve_model

    model = str(Path(tiny_checkpoint("mimo", hidden_size=128)).resolve())
    draft = str(resolve_model("stdlib-tiny-draft"))
    flags = [draft if f == "DRAFT" else f for f in flags]
    main(["receipt", model, *flags])
    printed = json.loads(capsys.readouterr().out)
    assert main(["generate", "--model", model, "--prompt", "x", "--max-tokens", "2", "--json", *flags]) == 0
    generated = json.loads(capsys.readouterr().out)["receipt"]
    assert generated == printed
    args = _subparser("receipt").parse_args([model, *flags])
    config = speculative_config(
        method=args.method,
        num_draft_tokens=args.num_draft_tokens,
        draft_model=args.draft_model,
        device_policy=args.device_policy,
    )
    context = ServingContext(quantized_kv=args.quantized_kv, chunked_prefill=args.chunked_prefill)
    assert json.loads(receipt_json(resolve(model, config, context=context))) == printed


def test_profile_is_accepted_by_both(tiny_checkpoint, tmp_path, capsys) -> None:
    profile = tmp_path / "p.toml"
    profile.write_text('method = "none"\nnum_draft_tokens = 2\n')
    model = str(Path(tiny_checkpoint("mimo", hidden_size=128)).resolve())
    assert main(["receipt", model, "--profile", str(profile)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert main(["generate", "--model", model, "--prompt", "x", "--json", "--profile", str(profile)]) == 0
    generated = json.loads(capsys.readouterr().out)
    assert generated["receipt"] == printed and printed["source"]["method"] == "profile"
    assert generated["method"] == "none"


def test_every_receipt_option_is_a_serve_option() -> None:
    receipt, serve = _options(_subparser("receipt")), _options(_subparser("serve"))
    missing = sorted(set(receipt) - set(serve) - RECEIPT_ONLY - {"-h", "--help"})
    assert not missing, f"serve lacks receipt options {missing}"
    for flag, action in receipt.items():
        if flag in RECEIPT_ONLY or flag in ("-h", "--help"):
            continue
        twin = serve[flag]
        assert (twin.dest, twin.choices, twin.type, type(twin), twin.default) == (
            action.dest, action.choices, action.type, type(action), action.default
        ), flag
