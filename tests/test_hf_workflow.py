"""Working from a Hugging Face GPT-2 directory: its tokenizer files, generate, eval, fine-tune,
and a trained run back out to `transformers`."""

import json

import pytest
import torch
import transformers  # a dev dependency: missing, it must fail, not skip
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import ByteLevelBPETokenizer

from conftest import V
from tlm import load_model, load_tokenizer
from tlm.cli import main
from tlm.data import prepare

TEXTS = ["", " leading space", "def f(x):\n\treturn x  # ü, 🙂, 中文\r\n", "a<|endoftext|>b", "  "]


@pytest.fixture(scope="module")
def reference(gpt2_files):
    """The `tokenizers` library's own byte-level BPE over the same vocab.json + merges.txt."""
    tok = ByteLevelBPETokenizer(str(gpt2_files / "vocab.json"), str(gpt2_files / "merges.txt"))
    tok.add_special_tokens(["<|endoftext|>"])
    return tok


@settings(max_examples=200, deadline=None)
@given(text=st.text(st.characters(blacklist_categories=("Cs",)), max_size=200))
def test_gpt2_tokenizer_files_round_trip_as_through_tokenizers(gpt2_files, reference, text):
    tok = load_tokenizer(gpt2_files)  # a folder with vocab.json + merges.txt only
    ids = tok.encode(text)
    assert ids == reference.encode(text).ids
    assert tok.decode(ids) == reference.decode(ids, skip_special_tokens=False) == text


def test_gpt2_tokenizer_saved_by_transformers_loads_the_same(gpt2_files, reference, tmp_path):
    slow = transformers.GPT2Tokenizer(
        str(gpt2_files / "vocab.json"), str(gpt2_files / "merges.txt")
    )
    slow.save_pretrained(tmp_path)  # tokenizer.json as Hugging Face writes it
    for folder in (gpt2_files, tmp_path):
        tok = load_tokenizer(folder)
        assert tok.eot_id == reference.token_to_id("<|endoftext|>")
        for text in TEXTS:
            assert tok.encode(text) == reference.encode(text).ids == slow.encode(text)


def test_generate_and_eval_read_a_hugging_face_directory(gpt2_dir, tmp_path, capsys):
    hf = transformers.GPT2LMHeadModel.from_pretrained(gpt2_dir).eval()
    tok = load_tokenizer(gpt2_dir)
    prompt = "The for statement"
    assert main(["generate", str(gpt2_dir), "--prompt", prompt, "--max-new-tokens", "12"]) == 0
    printed = capsys.readouterr().out
    ids = torch.tensor([[tok.eot_id, *tok.encode(prompt)]])  # tlm starts a prompt after EOT
    mask = torch.ones_like(ids)  # the leading EOT is a token, not padding
    expected = hf.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    assert printed.strip() == (prompt + tok.decode(expected[0, ids.shape[1] :].tolist())).strip()

    text = tmp_path / "t.txt"
    text.write_text("The list type is a sequence.")
    assert main(["eval", str(gpt2_dir), "--text", str(text), "--json"]) == 0
    loss = json.loads(capsys.readouterr().out)["loss"]
    ids = torch.tensor([[tok.eot_id, *tok.encode(text.read_text())]])
    with torch.no_grad():
        assert loss == pytest.approx(hf(ids, labels=ids).loss.item(), rel=1e-4)


@pytest.fixture(scope="module")
def gpt2_data(gpt2_dir, tmp_path_factory):
    """The python docs tokenized with the GPT-2 directory's tokenizer."""
    folder = tmp_path_factory.mktemp("data") / "docs-gpt2"
    prepare(["python-docs"], folder, tokenizer=str(gpt2_dir), progress=False)
    return folder


@pytest.mark.slow
def test_fine_tune_from_a_hugging_face_directory(gpt2_dir, gpt2_data, docs_chars, tmp_path, capsys):
    run, lr = tmp_path / "tuned", 1e-3
    args = ["train", "--data", str(gpt2_data), "--out", str(run), "--init-from", str(gpt2_dir)]
    args += ["--context-length", "32", "--batch-size", "2", "--max-steps", "1", "--quiet"]
    args += ["--lr", str(lr), "--warmup-steps", "0", "--weight-decay", "0", "--dropout", "0"]
    assert main([*args, "--resid-dropout", "0"]) == 0  # dropouts may differ from the source's
    assert json.loads((run / "config.json").read_text())["model"]["resid_dropout"] == 0.0
    tuned, source = load_model(run).state_dict(), load_model(gpt2_dir).state_dict()
    assert tuned["embedding.P"].shape[0] == 32  # the first 32 of GPT-2's 64 positions
    source["embedding.P"] = source["embedding.P"][:32]
    assert tuned.keys() == source.keys()
    # One AdamW step from the source: m̂ = g, v̂ = g², so each weight moves by
    # lr·g/(|g| + eps): at most lr, and almost exactly lr wherever g is not ~0 (only the key
    # biases b_K, which softmax ignores, get no gradient).
    moved = torch.cat([(tuned[k] - source[k]).abs().flatten() for k in source])
    assert moved.max() <= 1.01 * lr  # started from the checkpoint, not from new weights
    assert (moved > 0.5 * lr).float().mean() > 0.9  # and took the step

    capsys.readouterr()
    assert main(["eval", str(gpt2_dir), "--data", str(gpt2_data), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["loss"] > 0

    other = ["train", "--data", str(docs_chars), "--out", str(tmp_path / "x")]
    assert main([*other, "--init-from", str(gpt2_dir), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert f"prepare it again with --tokenizer {gpt2_dir}" in err


@pytest.mark.slow
def test_a_trained_run_exports_with_equal_logits(gpt2_data, tmp_path):
    run, out = tmp_path / "run", tmp_path / "hf"
    args = ["train", "--data", str(gpt2_data), "--out", str(run), "--n-layers", "2"]
    args += ["--d-model", "32", "--n-heads", "2", "--context-length", "32", "--batch-size", "4"]
    args += ["--activation", "gelu_tanh", "--max-steps", "10", "--quiet"]
    assert main(args) == 0
    assert main(["export-hf", str(run), str(out)]) == 0
    hf = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    model = load_model(run)
    ids = torch.randint(0, V, (2, 32), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.allclose(hf(ids).logits, model(ids), atol=1e-4, rtol=0)
    assert (out / "README.md").read_text() == (run / "MODEL_CARD.md").read_text()
