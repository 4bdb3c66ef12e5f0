"""The table of kinds (`tlm.kinds`): each path is claimed by its own kind and no other; a
path of no kind is one line; what the export commands write through the table comes back
through it with the same logits, config and tokenizer."""

import pytest
import torch

from conftest import save_run, tiny_config
from tlm import TransformerLM, load_model, load_tokenizer
from tlm.cli import main
from tlm.errors import UserError
from tlm.inference import for_inference
from tlm.kinds import KINDS, kind_of, writer_of
from tlm.load import model_config
from tlm.model import Encoder, EncoderDecoder
from tlm.tokenizer import CharTokenizer, encoder_tokenizer

TEXT = "The kind of a path, decided once."
READ_BACK = ["GPT-2", "GPT-NeoX", "GGUF"]  # the kinds tlm both writes and reads


def perturbed(model):
    """`model` with every bias and norm moved off its initial value (none is a no-op)."""
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "b_" in name or "gamma" in name or "beta" in name:
                param.add_(0.1 * torch.randn_like(param))
    return model.eval()


@pytest.fixture(scope="module")
def paths(tmp_path_factory, bpe_tokenizer):
    """One path of each kind in the table, the Hugging Face and GGUF ones written by the
    export commands from tlm runs."""
    tmp = tmp_path_factory.mktemp("kinds")
    torch.manual_seed(0)
    V = bpe_tokenizer.vocab_size
    save_run(tmp / "run", perturbed(TransformerLM(tiny_config(vocab_size=V))), bpe_tokenizer)
    rope = TransformerLM(tiny_config(vocab_size=V, position="rope", tie_embeddings=False))
    save_run(tmp / "rope", perturbed(rope), bpe_tokenizer)
    chars = CharTokenizer("abcdefghijklmnopqrstuvwxyz .")
    shape = dict(model_type="encoder-decoder", position="sinusoidal", norm="post")
    translation = EncoderDecoder(tiny_config(vocab_size=chars.vocab_size, **shape))
    save_run(tmp / "translation", perturbed(translation), chars)
    encoder = Encoder(tiny_config(vocab_size=V + 4, model_type="encoder", norm="post"))
    save_run(tmp / "encoder", perturbed(encoder), encoder_tokenizer(bpe_tokenizer))
    exports = [
        ["export-hf", "run", "gpt2"],
        ["export-hf", "rope", "neox"],
        ["export-hf", "translation", "marian"],
        ["export-hf", "encoder", "bert"],
        ["export-gguf", "run", "m.gguf"],
    ]
    for command, run, out in exports:
        assert main([command, str(tmp / run), str(tmp / out)]) == 0
    folders = {"tlm run": "run", "GPT-2": "gpt2", "GPT-NeoX": "neox", "Marian": "marian"}
    folders["BERT"] = "bert"
    return {name: tmp / folder for name, folder in {**folders, "GGUF": "m.gguf"}.items()}


def test_each_path_is_claimed_by_its_own_kind_and_no_other(paths, tmp_path):
    assert [kind.name for kind in KINDS] == list(paths)
    for name, path in paths.items():
        assert [kind.name for kind in KINDS if kind.detect(path)] == [name], path
    (tmp_path / "data").mkdir()  # a prepared data folder and a tokenizer.json: no model
    load_tokenizer(paths["tlm run"]).save(tmp_path / "data" / "tokenizer.json")
    for path in (tmp_path / "data", tmp_path / "data" / "tokenizer.json"):
        assert not any(kind.detect(path) for kind in KINDS)
        assert load_tokenizer(path).encode(TEXT) == load_tokenizer(paths["tlm run"]).encode(TEXT)


def test_a_path_of_no_kind_tlm_reads_is_one_line(paths, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("not a model")
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text('{"model_type": "llama"}')
    cases = {
        tmp_path / "missing": "none of what tlm reads",
        tmp_path / "empty": "none of what tlm reads",
        tmp_path / "notes.txt": "none of what tlm reads",
        tmp_path / "llama": "model_type 'llama'",
        paths["Marian"]: "model_type 'marian'",  # written by export-hf, not read
    }
    for path, message in cases.items():
        with pytest.raises(UserError, match=message):
            kind_of(path)
        assert main(["generate", str(path), "--prompt", "x"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("tlm: error:") and message in err and err.count("\n") == 1
        for kind in ("a tlm run", "model_type gpt2", "model_type gpt_neox", "bert", "GGUF file"):
            assert kind in err  # the message names every kind tlm reads


@pytest.mark.parametrize("name", READ_BACK)
def test_what_the_table_writes_comes_back_through_it(paths, name):
    source = {"GPT-NeoX": "rope"}.get(name, "run")
    run = paths["tlm run"].parent / source
    original, back = load_model(run), load_model(paths[name])
    assert kind_of(paths[name]).name == name
    assert model_config(paths[name]) == back.config
    ids = torch.randint(
        0, original.config.vocab_size, (2, 19), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        expected = original(ids)
        assert torch.allclose(back(ids), expected, atol=1e-5, rtol=0)
        streamed = load_model(paths[name], dtype="float32")  # the reader's weights part by part
        assert torch.allclose(streamed(ids), expected, atol=1e-4, rtol=0)
        packed = load_model(paths[name], dtype="int8")  # packed as each part is read
        if name == "GGUF":  # E is packed (not read in fp32 from a safetensors file)
            same = for_inference(load_model(paths[name]), "int8")
        else:  # the same weights, the same packing as the run's
            same = load_model(run, dtype="int8")
        assert torch.allclose(packed(ids), same(ids), atol=1e-5, rtol=0)
    assert load_tokenizer(paths[name]).encode(TEXT) == load_tokenizer(run).encode(TEXT)


def test_each_export_command_picks_its_writer_by_the_config():
    lm, rope = tiny_config(), tiny_config(position="rope")
    translation = tiny_config(model_type="encoder-decoder", position="sinusoidal", norm="post")
    picks = {
        (lm, "export-hf"): "GPT-2",
        (rope, "export-hf"): "GPT-NeoX",
        (translation, "export-hf"): "Marian",
        (tiny_config(model_type="encoder", norm="post"), "export-hf"): "BERT",
        (lm, "export-gguf"): "GGUF",
        (rope, "export-gguf"): "GGUF",
    }
    for (config, command), name in picks.items():
        assert writer_of(config, command).name == name


def test_a_draft_path_is_decided_once(paths, monkeypatch):
    """`tlm generate --draft PATH` reads the draft's tokenizer and its model through one
    decision of its kind (`load.source_of`), not one each."""
    import tlm.load
    from tlm.cli.generate import load_draft

    run = tlm.load.source_of(paths["tlm run"])
    asked = []
    for name in ("kind_of", "detected"):  # the two questions load asks of the table
        real = getattr(tlm.load, name)
        monkeypatch.setattr(tlm.load, name, lambda path, f=real, n=name: asked.append(n) or f(path))
    draft = load_draft(str(paths["GPT-2"]), run, "float32", "latest", load_tokenizer(run), "cpu")
    assert isinstance(draft, TransformerLM)
    assert asked == ["kind_of"]
