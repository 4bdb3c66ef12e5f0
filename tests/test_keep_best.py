"""--keep-best: best.safetensors holds the weights of the lowest validation loss, written only
when an evaluation beats every earlier one, kept across a resume, and read by
`load_model(weights="best")`, `tlm generate`, `tlm eval` and `tlm export-hf` (--weights best)."""

import json
from math import nan

import pytest
import torch
from safetensors.torch import load_file, safe_open

import tlm.train.loop as loop
from tlm import load_model
from tlm.checkpoint import BEST, CheckpointError, latest_checkpoint
from tlm.cli import main
from tlm.config import ModelConfig, TrainConfig
from tlm.data import open_data
from tlm.generate import GenerationConfig, complete
from tlm.interop.gpt2 import state_to_gpt2
from tlm.model.loss import cross_entropy_reference
from tlm.tokenizer import load_tokenizer
from tlm.train import Trainer, open_run

SHAPE = {"n_layers": 2, "d_model": 64, "n_heads": 2, "context_length": 16}


@pytest.fixture
def scripted(monkeypatch):
    """Validation losses from a list, in order; records the weights at each evaluation and
    the steps at which best.safetensors was written."""
    record = {"losses": [], "weights": {}, "best_writes": []}

    def validation_loss(self):
        record["weights"][self.state.step] = {
            k: v.clone() for k, v in self.model.state_dict().items()
        }
        return record["losses"].pop(0)

    save_weights = loop.save_weights

    def spy(path, weights, metadata=None):
        record["best_writes"].append(int(metadata["step"]))
        return save_weights(path, weights, metadata)

    monkeypatch.setattr(Trainer, "validation_loss", validation_loss)
    monkeypatch.setattr(loop, "save_weights", spy)
    return record


def trainer(docs_chars, run, max_steps, resume=False, **train) -> Trainer:
    """A tiny Trainer that evaluates every 2 steps, keeping the best unless told otherwise."""
    data = open_data(str(docs_chars))
    values = {"data": str(docs_chars), "out": str(run), "max_steps": max_steps}
    values |= {"batch_size": 4, "eval_interval": 2, "keep_best": True, **train}
    model_config = ModelConfig(vocab_size=data.vocab_size, **SHAPE)
    tokenizer_json = (docs_chars / "tokenizer.json").read_text()
    return open_run(model_config, TrainConfig(**values), data, tokenizer_json, resume, False)


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_best_is_written_only_when_the_loss_improves(docs_chars, tmp_path, scripted):
    run = tmp_path / "run"
    scripted["losses"] = [nan, 3.0, 2.0, 2.5, 1.5, 1.8]  # evaluations at steps 2, 4, ..., 12
    results = trainer(docs_chars, run, 12).fit()
    assert scripted["best_writes"] == [4, 6, 10]  # a NaN is no best, nor something to beat
    rows = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    assert [r["step"] for r in rows if r.get("best")] == [4, 6, 10]  # marked where written
    best = load_model(run, weights="best").state_dict()
    assert same(best, scripted["weights"][10])
    assert not same(best, load_model(run).state_dict())  # model.safetensors: step 12
    with safe_open(str(run / BEST), "pt") as f:
        assert f.metadata()["step"] == "10" and float(f.metadata()["val_loss"]) == 1.5
    assert (results["best_step"], results["best_val_loss"]) == (10, 1.5)
    state = json.loads((latest_checkpoint(run) / "state.json").read_text())
    assert (state["best_step"], state["best_loss"]) == (10, 1.5)
    card = (run / "MODEL_CARD.md").read_text()
    assert "| best validation loss (nats/token) | 1.5000 at step 10 (best.safetensors) |" in card
    assert f"tlm generate {run} --weights best" in card


@pytest.mark.slow
def test_resume_keeps_comparing_against_the_best(docs_chars, tmp_path, scripted):
    run = tmp_path / "run"
    scripted["losses"] = [3.0, 2.0, 2.5]  # steps 2, 4, 6: the best is step 4
    trainer(docs_chars, run, 6).fit()
    scripted["losses"] = [2.2, 1.9]  # steps 8 (worse than 2.0: kept) and 10 (better)
    resumed = trainer(docs_chars, run, 10, resume=True)
    assert (resumed.state.best_step, resumed.state.best_loss) == (4, 2.0)
    scripted["best_writes"].clear()
    resumed.fit()
    assert scripted["best_writes"] == [10]
    assert same(load_model(run, weights="best").state_dict(), scripted["weights"][10])


def test_without_keep_best_no_best_is_written_and_asking_is_one_line(
    docs_chars, tmp_path, scripted, capsys
):
    run = tmp_path / "run"
    scripted["losses"] = [3.0, 2.0]
    results = trainer(docs_chars, run, 4, keep_best=False).fit()
    assert not (run / BEST).exists() and scripted["best_writes"] == []
    assert (
        "best_step" not in results and "best validation" not in (run / "MODEL_CARD.md").read_text()
    )
    with pytest.raises(CheckpointError, match=f"{run} has no best.safetensors.*--keep-best"):
        load_model(run, weights="best")
    text = str(run / "config.json")
    commands = [
        ["generate", str(run)],
        ["eval", str(run), "--text", text],
        ["score", str(run), "--context", "The", "--continuation", " list"],
        ["classify", str(run), "--labels", "a,b", "--template", "{text}", "--input", text],
        ["ask", str(run), "What?"],
        ["summarize", str(run), text],
        ["inspect", str(run), "--prompt", "The", "--out", str(tmp_path / "inspect")],
    ]  # serve reads --weights the same way; a server that ignored it would not return
    for command in commands:
        assert main([*command, "--weights", "best"]) == 2
        err = capsys.readouterr().err
        assert "--keep-best" in err and str(run) in err and err.count("\n") == 1


def test_a_hugging_face_directory_has_no_best(gpt2_dir):
    with pytest.raises(CheckpointError, match="Hugging Face model"):
        load_model(gpt2_dir, weights="best")
    assert load_model(gpt2_dir, weights="latest") is not None


@pytest.mark.slow
def test_commands_read_the_best_weights(docs_chars, tmp_path, scripted, capsys):
    """`tlm train --keep-best` (the flag alone); generate, eval and export-hf --weights best."""
    run = tmp_path / "run"
    scripted["losses"] = [1.0, 2.0]  # the best is the first evaluation, step 5 of 10
    args = ["train", "--data", str(docs_chars), "--out", str(run), "--max-steps", "10"]
    args += [f"--{k.replace('_', '-')}={v}" for k, v in SHAPE.items()]
    args += ["--batch-size", "4", "--eval-interval", "5", "--lr", "1e-2", "--quiet", "--keep-best"]
    assert main(args) == 0
    assert "best: val loss 1.0000 at step 5" in capsys.readouterr().out
    best, latest = load_model(run, weights="best"), load_model(run)
    assert same(best.state_dict(), scripted["weights"][5])
    assert not same(best.state_dict(), latest.state_dict())
    tok = load_tokenizer(run)

    prompt = ["generate", str(run), "--prompt", "The", "--max-new-tokens", "12", "--json"]
    outputs = {}
    for weights in ("best", "latest"):
        assert main([*prompt, "--no-eos", "--weights", weights]) == 0
        outputs[weights] = json.loads(capsys.readouterr().out)["completions"][0]
    (expected,) = complete(best, tok, ["The"], GenerationConfig(max_new_tokens=12))
    assert outputs["best"]["tokens"] == expected.tokens
    assert outputs["best"]["logprobs"] == pytest.approx(expected.logprobs, abs=1e-5)
    assert outputs["latest"]["logprobs"] != pytest.approx(expected.logprobs, abs=1e-3)

    text = tmp_path / "t.txt"
    text.write_text("The list type.")
    assert main(["eval", str(run), "--text", str(text), "--json", "--weights", "best"]) == 0
    ids = torch.tensor([[tok.eot_id, *tok.encode("The list type.")]])
    with torch.no_grad():
        expected = cross_entropy_reference(best(ids[:, :-1]), ids[:, 1:]).item()
    assert json.loads(capsys.readouterr().out)["loss"] == pytest.approx(expected, rel=1e-5)

    score = ["score", str(run), "--context", "The", "--continuation", " list", "--json"]
    assert main([*score, "--weights", "best"]) == 0
    got = json.loads(capsys.readouterr().out)["continuations"][0]["logprob"]
    ids = torch.tensor([[tok.eot_id, *tok.encode("The list")]])
    with torch.no_grad():
        logprobs = best(ids[:, :-1]).log_softmax(-1)[0, -len(tok.encode(" list")) :]
    targets = ids[0, -len(tok.encode(" list")) :]
    assert got == pytest.approx(logprobs.gather(1, targets[:, None]).sum().item(), abs=1e-4)

    assert main(["export-hf", str(run), str(tmp_path / "hf"), "--weights", "best"]) == 0
    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert same(exported, state_to_gpt2(best.state_dict(), best.config))


def test_a_translation_run_keeps_its_best(tmp_path, scripted, monkeypatch, capsys):
    """A translation run keeps the best too; `tlm translate --weights best` reads it."""
    from tlm.data import prepare_pairs
    from tlm.generate.translate import translate

    words = ["sun", "dog", "cup", "red", "pen", "hat", "sky", "big"]
    src = [" ".join(words[i % 8 : i % 8 + 1 + i % 3]) for i in range(120)]
    (tmp_path / "a.src").write_text("\n".join(src) + "\n")
    (tmp_path / "a.tgt").write_text("\n".join(s[::-1] for s in src) + "\n")
    data, run = tmp_path / "data", tmp_path / "run"
    prepare_pairs(str(tmp_path / "a.src"), str(tmp_path / "a.tgt"), data, tokenizer="char")
    pairs = open_data(str(data))
    shape = {"model_type": "encoder-decoder", "position": "sinusoidal", "d_ff": 64}
    model_config = ModelConfig(vocab_size=pairs.vocab_size, **SHAPE, **shape)
    values = {"data": str(data), "out": str(run), "max_steps": 4, "eval_interval": 2}
    config = TrainConfig(**values, batch_tokens=128, keep_best=True, lr=0.3)
    tokenizer_json = (data / "tokenizer.json").read_text()
    scripted["losses"] = [1.0, 2.0]
    open_run(model_config, config, pairs, tokenizer_json, progress_bar=False).fit()
    assert scripted["best_writes"] == [2]
    best = load_model(run, weights="best")
    assert same(best.state_dict(), scripted["weights"][2])
    card = (run / "MODEL_CARD.md").read_text()
    assert "| best validation loss (nats/target token) | 1.0000 at step 2" in card
    assert f"tlm translate {run} --weights best" in card
    capsys.readouterr()
    assert main(["translate", "--beams", "1", str(run), "sun dog", "--weights", "best"]) == 0
    assert capsys.readouterr().out.splitlines() == translate(
        best, load_tokenizer(run), ["sun dog"], beams=1
    )
    (run / BEST).unlink()  # without it, both translation commands refuse --weights best
    (tmp_path / "t.src").write_text("sun dog\n")
    pairs = ["--src", str(tmp_path / "t.src"), "--ref", str(tmp_path / "t.src")]
    for argv in (["translate", str(run), "sun"], ["eval", str(run), "--task", "translate", *pairs]):
        assert main([*argv, "--weights", "best"]) == 2
        assert "--keep-best" in capsys.readouterr().err
