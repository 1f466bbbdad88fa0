"""The `afd` command: exit codes, one-line errors, help text, and the roundtrip check."""

from __future__ import annotations

import subprocess
import sys

import pytest

from afd_tools.cli import main


def test_roundtrip_passes_and_reports_what_it_checked(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["roundtrip", "--tokens", "64", "--hidden", "32", "--experts", "16"])
    out = capsys.readouterr().out
    assert code == 0
    assert "PASS: combined outputs match the per-token reference" in out
    assert "validated dispatch/reply header pairs" in out


@pytest.mark.parametrize("shared", ["attention", "ffn"])
def test_roundtrip_bf16_with_uneven_expert_split(
    shared: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "roundtrip",
        "--dtype",
        "bfloat16",
        "--shared",
        shared,
        "--ffn-ranks",
        "3",
        "--experts",
        "10",
        "--topk",
        "3",
        "--tokens",
        "40",
        "--hidden",
        "16",
    ]
    assert main(argv) == 0
    assert "PASS" in capsys.readouterr().out


def test_configuration_errors_are_one_line_messages(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["roundtrip", "--ffn-ranks", "80", "--experts", "64"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "use at most 64 FFN ranks" in err[0]


def test_console_script_help_lists_every_option() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "afd_tools.cli", "roundtrip", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    for option in (
        "--attention-ranks",
        "--ffn-ranks",
        "--experts",
        "--topk",
        "--tokens",
        "--hidden",
        "--shared",
        "--dtype",
        "--seed",
    ):
        assert option in result.stdout
    assert "default" in result.stdout
