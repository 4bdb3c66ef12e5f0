import json
import subprocess
import sys

from tlm import load_model
from tlm.cli import main

INFO_ARGS = ["--d-model", "512", "--n-layers", "6", "--n-heads", "8"]
INFO_ARGS += ["--vocab-size", "50257", "--context-length", "1024"]


def test_info_prints_the_breakdown(capsys):
    assert main(["info", *INFO_ARGS]) == 0
    out = capsys.readouterr().out
    for label in ("token embedding", "attention", "feed-forward", "layer norms", "total"):
        assert label in out
    assert "12·L·d²" in out and "18,874,368" in out  # 12 * 6 * 512**2


def test_info_json_matches_the_model_count(capsys):
    assert main(["info", "--json", "--d-model", "64", "--n-heads", "4", "--norm", "post"]) == 0
    report = json.loads(capsys.readouterr().out)
    from tlm import ModelConfig, TransformerLM

    model = TransformerLM(ModelConfig(**report["config"]))
    assert report["parameters"]["total"] == model.num_parameters()


def test_bad_config_is_one_line_and_exit_2(capsys):
    assert main(["info", "--d-model", "100", "--n-heads", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tlm: error:") and "n_heads" in err and "\n" not in err
    assert main(["info", "--position", "alibi"]) == 2
    assert "position" in capsys.readouterr().err


def test_python_dash_m_entry_point():
    result = subprocess.run(
        [sys.executable, "-m", "tlm", "info", "--help"], capture_output=True, text=True
    )
    assert result.returncode == 0 and "examples:\n  tlm info" in result.stdout


def test_info_reads_a_hugging_face_directory(gpt2_dir, capsys):
    assert main(["info", str(gpt2_dir), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["config"]["activation"] == "gelu_tanh" and printed["config"]["n_layers"] == 2
    assert printed["parameters"]["total"] == load_model(gpt2_dir).num_parameters()
