"""The app's keys off the command line (which every user can read with `ps`): --api-key-file and
--backend-key-file, their refusals, and the warnings for a key on the command line or in a file others read."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ui.cli import parse_args
from ui.key_file import MOST_KEY_FILE_BYTES

KEY = "k3y-from-a-file"


@pytest.fixture(autouse=True)
def no_keys_in_the_environment(monkeypatch):
    monkeypatch.delenv("INFINIGEN_API_KEY", raising=False)
    monkeypatch.delenv("INFINIGEN_BACKEND_KEY", raising=False)


def key_file(tmp_path: Path, content: str | bytes, mode: int = 0o600, name: str = "key") -> Path:
    path = tmp_path / name
    path.write_bytes(content.encode() if isinstance(content, str) else content)
    path.chmod(mode)
    return path


def refusal(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as stopped:
        parse_args(argv)
    assert stopped.value.code == 2
    return capsys.readouterr().err


def test_a_private_key_file_gives_its_one_line_without_a_warning(tmp_path, capsys):
    path = key_file(tmp_path, f"  {KEY}\n")
    args = parse_args(["--api-key-file", str(path), "--host", "0.0.0.0"])  # a key opens a non-loopback host
    assert args.api_key == KEY
    assert capsys.readouterr().err == ""


def test_a_key_on_the_command_line_still_works_but_says_who_can_see_it(capsys):
    assert parse_args(["--api-key", KEY]).api_key == KEY
    err = capsys.readouterr().err
    assert "--api-key is visible to every user" in err and "--api-key-file PATH" in err and "INFINIGEN_API_KEY" in err


def test_the_environment_variable_is_read_without_a_warning(monkeypatch, capsys):
    monkeypatch.setenv("INFINIGEN_API_KEY", KEY)
    assert parse_args([]).api_key == KEY
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("INFINIGEN_API_KEY", "  ")
    assert "INFINIGEN_API_KEY is blank" in refusal([], capsys)


def test_the_flag_and_its_file_are_one_or_the_other(tmp_path, capsys):
    err = refusal(["--api-key", KEY, "--api-key-file", str(key_file(tmp_path, KEY))], capsys)
    assert "not allowed with argument" in err


def test_a_file_others_may_read_is_used_with_a_warning(tmp_path, capsys):
    args = parse_args(["--api-key-file", str(key_file(tmp_path, KEY, mode=0o644))])
    assert args.api_key == KEY
    err = capsys.readouterr().err
    assert "can be read by its group and every user" in err and "chmod 600" in err
    parse_args(["--api-key-file", str(key_file(tmp_path, KEY, mode=0o640, name="group"))])
    err = capsys.readouterr().err
    assert "can be read by its group," in err and "every user" not in err


@pytest.mark.parametrize(("content", "why"), [
    ("", "the file is empty"),
    (" \n\t\n", "the file is empty"),
    ("first\nsecond\n", "more than one line"),
    (b"\xff\xfe\x00k", "not UTF-8 text"),
    ("k3y\x00with-a-nul", "holds control characters"),
    ("k" * (MOST_KEY_FILE_BYTES + 1), f"over {MOST_KEY_FILE_BYTES:,} bytes"),
], ids=["empty", "blank", "two-lines", "binary", "nul", "too-long"])
def test_a_file_that_holds_no_single_key_is_refused_saying_why(tmp_path, capsys, content, why):
    path = key_file(tmp_path, content)
    err = refusal(["--api-key-file", str(path)], capsys)
    assert f"--api-key-file {path}: {why}" in err


def test_a_missing_file_a_directory_and_a_device_are_refused(tmp_path, capsys):
    assert "no such file" in refusal(["--api-key-file", str(tmp_path / "nowhere")], capsys)
    assert "a directory, not a file" in refusal(["--api-key-file", str(tmp_path)], capsys)
    assert "not a regular file" in refusal(["--api-key-file", "/dev/zero"], capsys)  # not read for ever
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert "not a regular file" in refusal(["--api-key-file", str(fifo)], capsys)  # no writer: no hang


def test_an_editors_byte_order_mark_is_not_part_of_the_key(tmp_path, capsys):
    path = key_file(tmp_path, b"\xef\xbb\xbf" + KEY.encode() + b"\r\n")
    assert parse_args(["--api-key-file", str(path)]).api_key == KEY


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads every file")
def test_a_file_this_user_may_not_read_is_refused(tmp_path, capsys):
    path = key_file(tmp_path, KEY, mode=0o000)
    assert "this user may not read it" in refusal(["--api-key-file", str(path)], capsys)


def test_the_backend_key_has_a_file_too(tmp_path, capsys):
    path = key_file(tmp_path, "backend-secret\n")
    args = parse_args(["--backend", "http://gpu-box:8000/v1", "--backend-key-file", str(path)])
    assert args.backend_config.key == "backend-secret" and capsys.readouterr().err == ""
    parse_args(["--backend", "http://gpu-box:8000/v1", "--backend-key", "backend-secret"])
    assert "--backend-key is visible to every user" in capsys.readouterr().err
    assert "the file is empty" in refusal(["--backend", "http://gpu-box:8000/v1", "--backend-key-file",
                                           str(key_file(tmp_path, "", name="empty"))], capsys)
