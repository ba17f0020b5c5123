"""`speculant serve` flags: llama-server's names, one-line errors before the model loads."""
import socket

import pytest

from speculant_server.cli import main as serve_main


def test_help_lists_llama_server_flags(capsys):
    assert serve_main(["--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("-m MODEL", "-md", "--spec-type", "--host", "--port", "-c CTX_SIZE", "-np", "--api-key", "--alias",
                 "--spec-draft-n-max", "--spec-draft-n-min", "--spec-draft-p-min", "--temp", "--top-k", "-n N_PREDICT"):
        assert flag in out, flag


def test_unknown_spec_type_fails_before_loading(capsys, tmp_path):
    missing = tmp_path / "absent.gguf"  # never opened: the spec type is checked first
    assert serve_main(["-m", str(missing), "--spec-type", "warp-drive", "--port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown spec type 'warp-drive'" in err[0]


def test_port_in_use_fails_before_loading(capsys, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert serve_main(["-m", str(tmp_path / "absent.gguf"), "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"cannot listen on 127.0.0.1:{port}" in err[0]


def test_missing_model_is_one_line(capsys, tmp_path):
    assert serve_main(["-m", str(tmp_path / "absent.gguf"), "--port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "absent.gguf" in err[0]


@pytest.mark.parametrize("argv, words", [(["-np", "0"], "-np"), (["--port", "70000"], "--port"),
                                         (["--queue-size", "-1"], "--queue-size")])
def test_bad_flag_values(capsys, argv, words):
    assert serve_main(["-m", "x.gguf", *argv]) == 2
    assert words in capsys.readouterr().err


def test_speculant_serve_subcommand(capsys, tmp_path):
    from speculant.cli import main

    assert main(["serve", "--help"]) == 0
    assert "--api-key" in capsys.readouterr().out
    assert main(["serve", "-m", str(tmp_path / "absent.gguf"), "--spec-type", "warp-drive", "--port", "0"]) == 2
    assert "unknown spec type 'warp-drive'" in capsys.readouterr().err
