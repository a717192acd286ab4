"""The one config contract: precedence, sources, profiles, CLI/API parity, exit codes, schema."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from melix_fsm.cli import EXIT_OK, EXIT_REFUSED, EXIT_USAGE, build_parser, main
from melix_fsm.config import DevicePolicy, Method, Source, SpeculativeConfig, load_profile, speculative_config
from melix_fsm.errors import ConfigError, MelixError
from melix_fsm.receipt import ServingContext, receipt_json, resolve, schema_json, schema_path

from .conftest import Fakes


def test_defaults_and_sources() -> None:
    cfg = speculative_config()
    assert cfg == SpeculativeConfig()
    assert cfg.method is Method.mtp and cfg.num_draft_tokens == 1 and cfg.device_policy is DevicePolicy.auto
    assert {cfg.sources.method, cfg.sources.device_policy} == {Source.default}


def test_explicit_beats_profile_beats_default(tmp_path: Path) -> None:
    profile = tmp_path / "p.toml"
    profile.write_text(
        '[speculative]\nnum_draft_tokens = 3\ndevice_policy = "force_on"\n[server]\nport = 1\n'
    )
    cfg = speculative_config(profile=profile, device_policy="force_off")
    assert cfg.num_draft_tokens == 3 and cfg.sources.num_draft_tokens is Source.profile
    assert cfg.device_policy is DevicePolicy.force_off and cfg.sources.device_policy is Source.explicit
    assert cfg.method is Method.mtp and cfg.sources.method is Source.default


def test_json_profile_and_relative_draft_model(tmp_path: Path) -> None:
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps({"method": "draft_model", "draft_model": "small"}))
    cfg = speculative_config(profile=profile)
    assert cfg.draft_model == str(tmp_path / "small") and cfg.sources.draft_model is Source.profile


@pytest.mark.parametrize(
    "kwargs,setting",
    [
        ({"method": "eagle"}, "method"),
        ({"num_draft_tokens": 0}, "num_draft_tokens"),
        ({"num_draft_tokens": 99}, "num_draft_tokens"),
        ({"num_draft_tokens": True}, "num_draft_tokens"),
        ({"num_draft_tokens": "2"}, "num_draft_tokens"),
        ({"device_policy": "sometimes"}, "device_policy"),
        ({"method": "draft_model"}, "draft_model"),
        ({"method": "mtp", "draft_model": "x"}, "draft_model"),
        ({"draft_model": ""}, "draft_model"),
    ],
)
def test_bad_settings_raise_config_error(kwargs: dict, setting: str) -> None:
    with pytest.raises(ConfigError) as info:
        speculative_config(**kwargs)
    assert info.value.setting == setting and isinstance(info.value, MelixError)


@pytest.mark.parametrize(
    "name,content,text",
    [
        ("p.toml", "num_draft_tokens = [", "not valid TOML"),
        ("p.json", "{", "not valid JSON"),
        ("p.json", "[1]", "table/object"),
        ("p.toml", "assistant_model = 'x'", "unknown setting"),
        ("p.toml", "speculative = 3", "table/object"),
        ("p.yaml", "method: mtp", "must end in"),
        ("p.toml", "num_draft_tokens = 2.0", "not an integer"),
    ],
)
def test_bad_profiles(tmp_path: Path, name: str, content: str, text: str) -> None:
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(ConfigError, match=text):
        load_profile(path)


def test_profile_not_utf8_or_missing(tmp_path: Path) -> None:
    bad = tmp_path / "p.toml"
    bad.write_bytes(b"\xff\xfe")
    with pytest.raises(ConfigError, match="UTF-8"):
        load_profile(bad)
    with pytest.raises(ConfigError, match="cannot be read"):
        load_profile(tmp_path / "absent.json")


# -- CLI ----------------------------------------------------------------------------------


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, bytes, str]:
    status = main(["receipt", *argv])
    out, err = capsys.readouterr()
    return status, out.encode(), err


PARITY = [
    ([], {}),
    (["--method", "mtp", "--num-draft-tokens", "2"], {"method": "mtp", "num_draft_tokens": 2}),
    (["--method", "none"], {"method": "none"}),
    (["--device-policy", "force_off"], {"device_policy": "force_off"}),
    (
        ["--device-policy", "force_on", "--num-draft-tokens", "4"],
        {"device_policy": "force_on", "num_draft_tokens": 4},
    ),
    (["--num-draft-tokens", "auto"], {"num_draft_tokens": "auto"}),
]


@pytest.mark.parametrize("family", ["qwen3_5", "mimo", "glm4_moe", "llama"])
@pytest.mark.parametrize("argv,kwargs", PARITY)
def test_cli_and_api_receipts_are_byte_identical(
    fakes: Fakes, capsys: pytest.CaptureFixture[str], family: str, argv: list[str], kwargs: dict
) -> None:
    path = str(fakes.make(family))
    _, out, _ = _cli(capsys, path, *argv)
    assert out == receipt_json(resolve(path, speculative_config(**kwargs)))


def test_parity_with_profile_draft_model_and_context(
    fakes: Fakes, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    target, draft = str(fakes.make("llama")), str(fakes.make("llama"))
    profile = tmp_path / "serve.toml"
    profile.write_text(f'[speculative]\nmethod = "draft_model"\ndraft_model = "{draft}"\n')
    status, out, _ = _cli(
        capsys, target, "--profile", str(profile), "--num-draft-tokens", "3", "--quantized-kv"
    )
    api = resolve(
        target,
        speculative_config(profile=profile, num_draft_tokens=3),
        context=ServingContext(quantized_kv=True),
    )
    assert status == EXIT_OK and out == receipt_json(api)
    assert json.loads(out)["source"] == {
        "method": "profile",
        "num_draft_tokens": "explicit",
        "draft_model": "profile",
        "device_policy": "default",
    }


def test_exit_codes(fakes: Fakes, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert _cli(capsys, str(fakes.make("mimo")))[0] == EXIT_OK
    assert _cli(capsys, str(fakes.make("mimo", head=False)))[0] == EXIT_REFUSED
    assert _cli(capsys, str(fakes.make("mimo", head=False)), "--method", "none")[0] == EXIT_OK
    assert _cli(capsys, str(tmp_path / "absent"))[0] == EXIT_USAGE
    status, out, err = _cli(capsys, str(fakes.make("mimo")), "--num-draft-tokens", "0")
    assert status == EXIT_USAGE and out == b"" and "num_draft_tokens" in err
    status, out, err = _cli(capsys, str(fakes.make("mimo")), "--method", "draft_model")
    assert status == EXIT_USAGE and "draft model directory" in err
    status, _, err = _cli(capsys, str(fakes.make("mimo")), "--profile", str(tmp_path / "none.toml"))
    assert status == EXIT_USAGE and "cannot be read" in err
    status, _, err = _cli(capsys)
    assert status == EXIT_USAGE and "MODEL_DIR" in err


def test_argparse_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["receipt", "x", "--num-draft-tokens", "two"], ["receipt", "x", "--method", "assistant"]):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == EXIT_USAGE
    capsys.readouterr()


def test_help_and_defaults_do_not_advertise_sidecars(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    sub = parser._subparsers._group_actions[0].choices["receipt"]  # type: ignore[union-attr]
    text = (sub.format_help() + json.dumps(SpeculativeConfig().__struct_fields__)).lower()
    for word in ("sidecar", "assistant", "eagle", "medusa"):
        assert word not in text


def test_schema_file_is_not_stale() -> None:
    assert schema_path().read_bytes() == schema_json(), (
        "spec/receipt.schema.json is stale: run `melix-fsm receipt --schema > spec/receipt.schema.json`"
    )


def test_schema_cli_prints_the_schema(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = _cli(capsys, "--schema")
    assert status == EXIT_OK and out == schema_json()
    assert json.loads(out)["$id"] == "melix-fsm/receipt/4"


def test_direct_construction_is_checked_too() -> None:
    assert SpeculativeConfig(method="none", device_policy="force_on").method is Method.none  # type: ignore[arg-type]
    for kwargs in ({"num_draft_tokens": 0}, {"method": "draft_model"}, {"device_policy": "x"}):
        with pytest.raises(ConfigError):
            SpeculativeConfig(**kwargs)  # type: ignore[arg-type]


def test_auto_depth_is_a_config_value_from_every_front_end(tmp_path: Path) -> None:
    cfg = speculative_config(num_draft_tokens="auto")
    assert cfg.num_draft_tokens == "auto" and cfg.sources.num_draft_tokens is Source.explicit
    profile = tmp_path / "p.toml"
    profile.write_text('num_draft_tokens = "auto"\n')
    assert speculative_config(profile=profile).num_draft_tokens == "auto"
    for bad in ("Auto", "2", 2.0, "max"):
        with pytest.raises(ConfigError, match="num_draft_tokens"):
            speculative_config(num_draft_tokens=bad)


def test_num_draft_tokens_flag_takes_auto_and_refuses_words(capsys: pytest.CaptureFixture[str]) -> None:
    from melix_fsm.config import int_or_auto

    assert int_or_auto("auto") == "auto" and int_or_auto("3") == 3
    with pytest.raises(SystemExit) as exc:  # argparse's usage error
        main(["receipt", "/nonexistent", "--num-draft-tokens", "many"])
    assert exc.value.code == EXIT_USAGE and "--num-draft-tokens" in capsys.readouterr().err
