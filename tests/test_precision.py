"""The training precision: `--precision auto` is bf16 autocast on a CPU with bf16 units and fp32
on one without (where `--precision bfloat16` is refused); the choice is written down; bf16
training follows fp32's loss curve and its model scores the same in either precision."""

import json
import os
import subprocess
import sys

import pytest
import torch

from tlm.cli import main
from tlm.config import ConfigError
from tlm.model.attention import attention_fused, attention_reference, causal_mask
from tlm.train import attention_kernel, new_run_configs, open_run
from tlm.train import precision as precisions
from tlm.train.attention_kernel import causal_attention
from tlm.train.precision import bf16_units, pick_precision

TINY = ["--n-layers", "2", "--d-model", "32", "--n-heads", "2", "--context-length", "32"]
TINY += ["--batch-size", "8", "--warmup-steps", "5", "--log-interval", "5", "--quiet"]
CPU = torch.device("cpu")
NATIVE = bf16_units() is not None  # this host's own answer


@pytest.fixture
def without_bf16(monkeypatch):
    """A CPU without bf16 units, whatever this host has."""
    monkeypatch.setattr(precisions, "bf16_units", lambda: None)


@pytest.fixture
def with_bf16(monkeypatch):
    """A CPU with AVX512_BF16 (on a host without, bf16 is emulated: right, only slower)."""
    monkeypatch.setattr(precisions, "bf16_units", lambda: "AVX512_BF16")


def train(data, out, *extra):
    return main(["train", "--data", str(data), "--out", str(out), *TINY, *extra])


def losses(run) -> list[float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["train_loss"] for r in rows if "train_loss" in r]


def test_auto_is_bf16_only_where_the_cpu_has_bf16_units(without_bf16):
    assert pick_precision("auto", CPU).dtype == torch.float32
    assert pick_precision("float32", CPU).dtype == torch.float32
    with pytest.raises(ConfigError, match="no bf16 units .* use --precision auto or float32"):
        pick_precision("bfloat16", CPU)
    assert pick_precision("auto", torch.device("cuda")).dtype == torch.bfloat16


def test_an_avx512_host_held_to_avx2_has_no_bf16_units():
    """ATEN_CPU_CAPABILITY=avx2 runs an AVX-512 host as an AVX2-only one: --precision auto is
    fp32 there, as on such a host (a fresh process: torch reads it when it starts)."""
    script = "from tlm.train.precision import bf16_units; print(bf16_units())"
    env = os.environ | {"ATEN_CPU_CAPABILITY": "avx2"}
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    assert run.stdout.strip() == "None", run.stderr


def test_auto_on_a_cpu_with_bf16_units_says_which(with_bf16):
    chosen = pick_precision("auto", CPU)
    assert chosen.dtype == torch.bfloat16 and "AVX512_BF16" in str(chosen)
    assert pick_precision("float32", CPU).dtype == torch.float32  # asked: kept


def test_bfloat16_on_a_cpu_without_units_is_one_line_and_writes_nothing(
    docs_chars, tmp_path, capsys, without_bf16
):
    assert train(docs_chars, tmp_path / "run", "--max-steps", "2", "--precision", "bfloat16") == 2
    error = capsys.readouterr().err.strip()
    assert "no bf16 units" in error and "\n" not in error
    assert not (tmp_path / "run").exists()


def test_without_bf16_units_auto_is_fp32_exactly(docs_chars, tmp_path, without_bf16):
    assert train(docs_chars, tmp_path / "auto", "--max-steps", "10") == 0
    assert train(docs_chars, tmp_path / "fp32", "--max-steps", "10", "--precision", "float32") == 0
    assert losses(tmp_path / "auto") == losses(tmp_path / "fp32")
    config = json.loads((tmp_path / "auto" / "config.json").read_text())
    assert (
        config["precision"]["dtype"] == "float32" and "no bf16 units" in config["precision"]["why"]
    )


def test_the_choice_is_in_config_json_the_card_and_the_first_line(
    docs_chars, tmp_path, capsys, with_bf16
):
    run = tmp_path / "run"
    args = ["train", "--data", str(docs_chars), "--out", str(run), *TINY[:-1], "--max-steps", "2"]
    assert main(args) == 0
    first = capsys.readouterr().err.splitlines()[0]
    assert "bf16 autocast" in first and "AVX512_BF16" in first
    assert json.loads((run / "config.json").read_text())["precision"]["dtype"] == "bfloat16"
    assert (
        "Precision: bf16 autocast: the CPU multiplies bf16 natively (AVX512_BF16)"
        in (run / "MODEL_CARD.md").read_text()
    )


def test_muon_orthogonalizes_in_the_training_precision(docs_chars, tmp_path, with_bf16):
    values = {"data": str(docs_chars), "out": str(tmp_path / "run"), "optimizer": "muon"}
    shape = {"n_layers": 1, "d_model": 16, "n_heads": 2, "context_length": 16}
    model_config, train_config, data = new_run_configs(shape, values)
    tokenizer = (docs_chars / "tokenizer.json").read_text()
    trainer = open_run(model_config, train_config, data, tokenizer, progress_bar=False)
    assert trainer.optimizer.optimizers[0].ns_dtype == torch.bfloat16


@pytest.mark.slow
@pytest.mark.skipif(not NATIVE, reason="a host without bf16 units emulates it: too slow")
def test_bf16_training_follows_fp32_and_scores_the_same_either_way(
    docs_chars, tmp_path, monkeypatch
):
    """50 steps each way, same seed: the logged losses agree (bf16 rounds the products, so
    the curves drift apart a little, never by 0.02 nats); the bf16 model's validation loss
    under bf16 autocast (as training scores it) and in fp32 agree within 0.01 nats. One head
    of 32: bf16 runs tlm's attention kernel, as a real run's heads of 32 or 64 do."""
    trainers, seen = {}, []  # the precision attention ran in, call by call (a mark of the path)
    real = attention_kernel._precision
    monkeypatch.setattr(attention_kernel, "_precision", lambda q: seen.append(real(q)) or seen[-1])
    for name in ("bfloat16", "float32"):
        seen.clear()
        values = {"data": str(docs_chars), "out": str(tmp_path / name), "max_steps": 50}
        values |= {"precision": name, "lr": 3e-3, "batch_size": 8, "log_interval": 5}
        shape = {"n_layers": 2, "d_model": 32, "n_heads": 1, "context_length": 32}
        model_config, train_config, data = new_run_configs(shape, values)
        tokenizer = (docs_chars / "tokenizer.json").read_text()
        trainers[name] = open_run(model_config, train_config, data, tokenizer, progress_bar=False)
        trainers[name].fit()
        assert seen and set(seen) == {getattr(torch, name)}  # every step ran in that precision
    assert trainers["bfloat16"].model.blocks[0].attn.fused is causal_attention
    bf16, fp32 = losses(tmp_path / "bfloat16"), losses(tmp_path / "float32")
    assert fp32[-1] < fp32[0] - 0.5  # it learned
    assert max(abs(a - b) for a, b in zip(bf16, fp32, strict=True)) < 0.02, (bf16, fp32)
    trainer = trainers["bfloat16"]
    in_bf16 = trainer.validation_loss()
    trainer.precision = pick_precision("float32", CPU)
    assert abs(in_bf16 - trainer.validation_loss()) < 0.01


def test_attention_under_bf16_autocast_on_a_cpu_is_fp32_attention_of_the_rounded_inputs():
    """PyTorch's CPU attention kernel is slower in bf16 than in fp32, so under bf16 autocast
    it is given the bf16 q, k, v in fp32: its answer is fp32 attention's, not bf16's."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 16, 8).bfloat16() for _ in range(3))
    expected, _ = attention_reference(q.float(), k.float(), v.float(), causal_mask(16, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused = attention_fused(q, k, v, is_causal=True)
    assert fused.dtype == torch.float32
    assert torch.allclose(fused, expected, atol=1e-5)
    in_bf16 = attention_fused(q, k, v, is_causal=True)  # no autocast: the bf16 kernel
    assert not torch.allclose(in_bf16.float(), expected, atol=1e-5)  # which the test tells apart
