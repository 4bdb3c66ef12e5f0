"""Hugging Face GPT-2 interop: import, export, round trips; `transformers` is the reference."""

import logging

import pytest
import torch
import transformers  # a dev dependency: missing, it must fail, not skip
from safetensors.torch import load_file, save_file

from conftest import V, assert_same_logits, hf_model, save_run, tiny_config
from tlm import TransformerLM, load_model, load_tokenizer
from tlm.cli import main
from tlm.interop import HFFormatError
from tlm.kinds import export_hf


def export_run(run, out):
    return export_hf(load_model(run), load_tokenizer(run), out, run / "MODEL_CARD.md")


def make_run(folder, tokenizer, **overrides):
    """A run directory of a random tlm model (no training needed for parity)."""
    config = tiny_config(**{"vocab_size": V, **overrides})
    torch.manual_seed(1)
    model = TransformerLM(config)
    with torch.no_grad():  # non-trivial biases and norms, so a misplaced one shows
        for name, param in model.named_parameters():
            if "b_" in name or "gamma" in name or "beta" in name:
                param.add_(0.1 * torch.randn_like(param))
    save_run(folder, model, tokenizer)
    return model


def load_hf(folder):
    """GPT2LMHeadModel.from_pretrained, asserting nothing was missing or unexpected."""
    model, info = transformers.GPT2LMHeadModel.from_pretrained(folder, output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    return model.eval()


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"activation_function": "gelu", "layer_norm_epsilon": 1e-6},
        {"activation_function": "relu", "n_inner": 48},
        {"activation_function": "relu2"},  # ReLU², a small-budget option (not the book's)
        {"tie_word_embeddings": False},
    ],
)
def test_imported_gpt2_logits_equal_hugging_face(tmp_path, overrides):
    hf = hf_model(**overrides)
    hf.save_pretrained(tmp_path)
    model = load_model(tmp_path)
    assert model.config.norm == "pre" and model.config.position == "learned"
    torch.manual_seed(2)
    with torch.no_grad():
        for T in (1, 7, 64):
            ids = torch.randint(0, V, (2, T))
            assert torch.allclose(model(ids), hf(ids).logits, atol=1e-4, rtol=0)


def test_imported_gpt2_generates_the_same_greedy_tokens(gpt2_dir):
    hf, model = load_hf(gpt2_dir), load_model(gpt2_dir)
    prompt = torch.randint(0, V, (1, 5), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(prompt)
    expected = hf.generate(prompt, attention_mask=mask, max_new_tokens=30, do_sample=False)
    for use_cache in (True, False):
        got = model.generate(prompt, max_new_tokens=30, use_cache=use_cache)
        assert torch.equal(got, expected)


def test_pytorch_model_bin_loads_without_pickle(tmp_path, capsys):
    hf = hf_model()
    hf.save_pretrained(tmp_path / "bin")  # then the older format, as checkpoints of 2019 are
    (tmp_path / "bin" / "model.safetensors").unlink()
    torch.save(hf.state_dict(), tmp_path / "bin" / "pytorch_model.bin")
    ids = torch.randint(0, V, (1, 9))
    with torch.no_grad():
        assert torch.allclose(load_model(tmp_path / "bin")(ids), hf(ids).logits, atol=1e-4)

    class Payload:  # a pickle that would run code is refused, not executed
        def __reduce__(self):
            return (print, ("pickle ran",))

    evil = tmp_path / "evil"
    evil.mkdir()
    (evil / "config.json").write_text((tmp_path / "bin" / "config.json").read_text())
    torch.save({"x": Payload()}, evil / "pytorch_model.bin")
    with pytest.raises(HFFormatError, match="cannot read the weights"):
        load_model(evil)
    assert "pickle ran" not in capsys.readouterr().out


def test_sharded_safetensors_load(tmp_path):
    hf = hf_model()
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    ids = torch.randint(0, V, (1, 11))
    with torch.no_grad():
        assert torch.allclose(load_model(tmp_path)(ids), hf(ids).logits, atol=1e-4)


def test_original_gpt2_layout_loads(tmp_path):
    """The hub's gpt2 files: no `transformer.` prefix, causal-mask buffers, a stored tied head."""
    hf = hf_model()
    hf.save_pretrained(tmp_path)
    tensors = {k.removeprefix("transformer."): v.clone() for k, v in hf.state_dict().items()}
    for layer in range(2):
        tensors[f"h.{layer}.attn.bias"] = torch.ones(1, 1, 64, 64).tril()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    assert "lm_head.weight" in tensors and "h.0.attn.c_attn.weight" in tensors
    ids = torch.randint(0, V, (2, 20))
    with torch.no_grad():
        assert torch.allclose(load_model(tmp_path)(ids), hf(ids).logits, atol=1e-4)
    tensors["h.0.extra.weight"] = torch.zeros(3)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(HFFormatError, match="unexpected tensors in the checkpoint: h.0.extra"):
        load_model(tmp_path)


@pytest.mark.parametrize(
    "overrides",
    [
        {"activation": "gelu_tanh"},
        {"activation": "gelu"},
        {"activation": "relu", "d_ff": 96},
        {"activation": "relu2"},
        {"position": "sinusoidal"},
        {"bias": False},
        {"tie_embeddings": False, "layer_norm_eps": 1e-6},
    ],
)
def test_export_opens_in_transformers_with_equal_logits(tmp_path, bpe_tokenizer, caplog, overrides):
    model = make_run(tmp_path / "run", bpe_tokenizer, **overrides).eval()
    assert main(["export-hf", str(tmp_path / "run"), str(tmp_path / "hf")]) == 0
    with caplog.at_level(logging.WARNING):
        hf = load_hf(tmp_path / "hf")
    assert not caplog.records  # no warning of any kind, about weights or the config
    assert_same_logits(hf, model)


def test_exported_tokenizer_opens_in_transformers(tmp_path, bpe_tokenizer, caplog):
    make_run(tmp_path / "run", bpe_tokenizer)
    export_run(tmp_path / "run", tmp_path / "hf")
    with caplog.at_level(logging.WARNING):
        auto = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert not caplog.records
    text = "def f(x):\n    return x  # ünïcode, 🙂 and <|endoftext|> too\n\n"
    ids = bpe_tokenizer.encode(text)
    assert auto(text)["input_ids"] == ids and auto.decode(ids) == text
    assert auto.eos_token_id == bpe_tokenizer.eot_id


def test_exported_char_tokenizer_opens_in_transformers(tmp_path, docs_chars):
    chars = load_tokenizer(docs_chars)
    model = make_run(tmp_path / "run", chars, vocab_size=chars.vocab_size)
    export_run(tmp_path / "run", tmp_path / "hf")
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "The for statement:\n\n   for x in y:<|endoftext|>"
    assert auto(text)["input_ids"] == chars.encode(text)
    assert auto.decode(chars.encode(text)) == text
    assert load_hf(tmp_path / "hf").config.vocab_size == model.config.vocab_size
    back = load_tokenizer(tmp_path / "hf")  # read back by tlm: the same ids and byte counts
    assert back.encode(text) == chars.encode(text)
    assert back.token_bytes().tolist() == chars.token_bytes().tolist()


def test_round_trip_hf_tlm_hf_gives_identical_tensors(gpt2_dir, tmp_path):
    assert main(["export-hf", str(gpt2_dir), str(tmp_path / "again")]) == 0
    before = load_file(str(gpt2_dir / "model.safetensors"))
    after = load_file(str(tmp_path / "again" / "model.safetensors"))
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    again = load_tokenizer(tmp_path / "again")
    assert again.to_json() == load_tokenizer(gpt2_dir).to_json()


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"position": "none"}, "position='none'"),
        ({"norm": "post"}, "norm='post'"),
        ({"d_head": 8}, "d_head=8"),
        ({"qk_norm": True}, "qk_norm"),
    ],
)
def test_export_refuses_what_gpt2_cannot_express(tmp_path, bpe_tokenizer, capsys, overrides, field):
    make_run(tmp_path / "run", bpe_tokenizer, **overrides)
    assert main(["export-hf", str(tmp_path / "run"), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert field in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "hf").exists()


def test_export_never_overwrites_a_folder(tmp_path, bpe_tokenizer, capsys):
    make_run(tmp_path / "run", bpe_tokenizer)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "notes.txt").write_text("keep me")
    assert main(["export-hf", str(tmp_path / "run"), str(tmp_path / "hf")]) == 2
    assert "not empty" in capsys.readouterr().err
    assert (tmp_path / "hf" / "notes.txt").read_text() == "keep me"


def test_unreadable_hf_configs_are_one_line_errors(tmp_path, capsys):
    hf_model(scale_attn_by_inverse_layer_idx=True).save_pretrained(tmp_path / "scaled")
    with pytest.raises(HFFormatError, match="scale_attn_by_inverse_layer_idx"):
        load_model(tmp_path / "scaled")
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text('{"model_type": "llama"}')
    assert main(["generate", str(tmp_path / "llama"), "--prompt", "x"]) == 2
    assert "model_type 'llama'" in capsys.readouterr().err
