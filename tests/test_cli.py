import json
import subprocess
import sys

import pytest

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


@pytest.mark.slow
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


def test_help_lists_every_command_and_a_typo_names_them(capsys, monkeypatch):
    """In this process (`python -m tlm` has its own test): argparse prints and exits."""
    from tlm.cli import COMMANDS

    monkeypatch.setenv("COLUMNS", "80")  # the width a pipe gets, whatever the terminal
    with pytest.raises(SystemExit) as stopped:
        main(["--help"])
    assert stopped.value.code == 0
    out = capsys.readouterr().out
    listed = {line.split()[0] for line in out.splitlines() if line.startswith("    ")}
    assert listed >= set(COMMANDS)
    with pytest.raises(SystemExit) as stopped:
        main(["prepar"])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and "invalid choice: 'prepar'" in err
    assert "'prepare'" in err and "'export-hf'" in err


def test_prepare_runs_without_loading_pytorch(tmp_path):
    """Only the command being run is imported: `tlm prepare` (and its workers) never pay
    PyTorch's 1.4 s import, a quarter of preparing 10 MB."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("to be or not to be, that is the question\n" * 200)
    script = (
        "import sys\nfrom tlm.cli import main\n"
        f"code = main(['prepare', {str(corpus)!r}, '--vocab-size', '270', '--quiet',"
        f" '--out', {str(tmp_path / 'data')!r}])\n"
        "print(code, 'torch' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.stdout.split()[-2:] == ["0", "False"], result.stderr


def test_every_error_the_cli_prints_in_one_line_is_a_user_error():
    """The command line catches `UserError` alone; each module's error must derive from it
    (or its messages would become tracebacks)."""
    from tlm.checkpoint import CheckpointError, NonFiniteWeights
    from tlm.cli.args import UsageError
    from tlm.config import ConfigError
    from tlm.data import CorpusError
    from tlm.errors import UserError
    from tlm.generate import GenerationError
    from tlm.interop import HFFormatError
    from tlm.interpret import HookError
    from tlm.io import FolderError
    from tlm.scaling import FitError, SweepError
    from tlm.tasks import TaskError
    from tlm.tokenizer import TokenizerError
    from tlm.train import RunError

    errors = [CheckpointError, NonFiniteWeights, UsageError, ConfigError, CorpusError]
    errors += [GenerationError, HFFormatError, HookError, FolderError, FitError, SweepError]
    errors += [TaskError, TokenizerError, RunError]
    for error in errors:
        assert issubclass(error, UserError), error
        assert issubclass(error, ValueError), error  # what callers caught before


def test_info_counts_an_encoder_decoder(capsys):
    args = ["--model-type", "encoder-decoder", "--n-encoder-layers", "2", "--n-layers", "3"]
    assert main(["info", *args, "--position", "sinusoidal", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    from tlm import ModelConfig
    from tlm.model import EncoderDecoder

    model = EncoderDecoder(ModelConfig(**report["config"]))
    assert report["parameters"]["total"] == model.num_parameters()
    assert main(["info", *args, "--position", "sinusoidal"]) == 0
    assert capsys.readouterr().out.startswith("EncoderDecoder: 2 encoder + 3 decoder layers")
