"""Rotary models <-> Hugging Face GPT-NeoX: export, import, round trips, gradients, refusals;
`transformers`' GPTNeoXForCausalLM is the reference."""

import json
import logging

import pytest
import torch
import transformers  # a dev dependency: missing, it must fail, not skip
from safetensors.torch import load_file

from conftest import V, assert_same_logits, save_run, tiny_config
from tlm import TransformerLM, load_model, load_tokenizer
from tlm.cli import main
from tlm.data import prepare


def make_run(folder, tokenizer, **overrides):
    """A run directory of a random rotary model, biases and norms perturbed."""
    config = tiny_config(**{"vocab_size": V, "position": "rope", **overrides})
    torch.manual_seed(1)
    model = TransformerLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "b_" in name or "gamma" in name or "beta" in name:
                param.add_(0.1 * torch.randn_like(param))
    save_run(folder, model, tokenizer)
    return model.eval()


def load_neox(folder):
    """GPTNeoXForCausalLM.from_pretrained, asserting nothing was missing or unexpected."""
    model, info = transformers.GPTNeoXForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    return model.eval()


def neox_model(**overrides):
    """A random GPTNeoXForCausalLM of a shape tlm computes, biases and norms perturbed."""
    values = dict(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=64, use_parallel_residual=False,
        rotary_pct=1.0, rotary_emb_base=500.0, tie_word_embeddings=False,
    )  # fmt: skip
    values.update(overrides)
    torch.manual_seed(0)
    model = transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(**values)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "layernorm" in name or "layer_norm" in name:
                param.add_(0.1 * torch.randn_like(param))
    return model


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"activation": "gelu_tanh", "rope_base": 500.0},
        {"activation": "relu2", "d_ff": 96},
        {"bias": False},
        {"tie_embeddings": False, "layer_norm_eps": 1e-6},
    ],
)
def test_a_rotary_export_opens_as_gptneox_with_equal_logits(
    tmp_path, bpe_tokenizer, caplog, overrides
):
    model = make_run(tmp_path / "run", bpe_tokenizer, **overrides)
    assert main(["export-hf", str(tmp_path / "run"), str(tmp_path / "hf")]) == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == "gpt_neox" and config["use_parallel_residual"] is False
    with caplog.at_level(logging.WARNING):
        hf = load_neox(tmp_path / "hf")
        auto = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert not caplog.records  # no warning of any kind, about weights or the config
    assert_same_logits(hf, model)
    text = "def f(x):\n    return x  # ünïcode and <|endoftext|> too\n"
    assert auto(text)["input_ids"] == bpe_tokenizer.encode(text)


def test_a_round_trip_through_gptneox_is_exact(tmp_path, bpe_tokenizer):
    model = make_run(tmp_path / "run", bpe_tokenizer, tie_embeddings=False)
    assert main(["export-hf", str(tmp_path / "run"), str(tmp_path / "hf")]) == 0
    back = load_model(tmp_path / "hf")
    assert back.config.position == "rope" and back.config.rope_base == model.config.rope_base
    mine, theirs = model.state_dict(), back.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert main(["export-hf", str(tmp_path / "hf"), str(tmp_path / "again")]) == 0
    before = load_file(str(tmp_path / "hf" / "model.safetensors"))
    after = load_file(str(tmp_path / "again" / "model.safetensors"))
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert load_tokenizer(tmp_path / "again").to_json() == bpe_tokenizer.to_json()


@pytest.mark.parametrize("tied", [False, True])
def test_a_gptneox_directory_loads_with_equal_logits_and_gradients(tmp_path, tied):
    hf = neox_model(tie_word_embeddings=tied)
    hf.save_pretrained(tmp_path)
    model = load_model(tmp_path)
    assert model.config.tie_embeddings == tied and model.config.rope_base == 500.0
    ids = torch.randint(0, V, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.allclose(model(ids), hf(ids).logits, atol=1e-4, rtol=0)
    ours = torch.nn.functional.cross_entropy(model(ids)[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    ours.backward()
    hf(ids, labels=ids).loss.backward()
    E = model.embedding.E.grad  # the token embedding: both sides name it, and it is [V, d]
    assert torch.allclose(E, hf.gpt_neox.embed_in.weight.grad, atol=1e-5, rtol=1e-4)
    W_1 = model.blocks[1].ffn.W_1.grad  # [d, d_ff]: nn.Linear's [d_ff, d] transposed
    theirs = hf.gpt_neox.layers[1].mlp.dense_h_to_4h.weight.grad.t()
    assert torch.allclose(W_1, theirs, atol=1e-5, rtol=1e-4)
    W_Q = model.blocks[0].attn.W_Q.grad  # head by head in their fused rows
    fused = hf.gpt_neox.layers[0].attention.query_key_value.weight.grad
    H, dh = model.config.n_heads, model.config.d_head
    theirs = fused.reshape(H, 3, dh, -1)[:, 0].reshape(H * dh, -1).t()
    assert torch.allclose(W_Q, theirs, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"use_parallel_residual": True}, "use_parallel_residual=True"),
        ({"rotary_pct": 0.25}, "partial_rotary_factor=0.25"),
        ({"hidden_act": "silu"}, "hidden_act 'silu'"),
    ],
)
def test_a_gptneox_directory_tlm_does_not_compute_is_one_line(tmp_path, capsys, overrides, field):
    neox_model(**overrides).save_pretrained(tmp_path)
    capsys.readouterr()  # transformers' own progress bar
    assert main(["generate", str(tmp_path), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert field in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"norm": "post"}, "norm='post'"),
        ({"d_head": 8}, "d_head=8"),
        ({"qk_norm": True}, "qk_norm"),
    ],
)
def test_export_refuses_what_gptneox_cannot_express(
    tmp_path, bpe_tokenizer, capsys, overrides, field
):
    make_run(tmp_path / "run", bpe_tokenizer, **overrides)
    assert main(["export-hf", str(tmp_path / "run"), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert "GPT-NeoX" in err and field in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "hf").exists()


@pytest.mark.slow
def test_fine_tune_from_a_gptneox_directory(tmp_path, bpe_tokenizer):
    make_run(tmp_path / "run", bpe_tokenizer)
    assert main(["export-hf", str(tmp_path / "run"), str(tmp_path / "hf")]) == 0
    data = tmp_path / "data"
    prepare(["python-docs"], data, tokenizer=str(tmp_path / "hf"), progress=False)
    run, lr = tmp_path / "tuned", 1e-3
    args = ["train", "--data", str(data), "--out", str(run), "--init-from", str(tmp_path / "hf")]
    args += ["--context-length", "16", "--batch-size", "2", "--max-steps", "1", "--quiet"]
    assert main([*args, "--lr", str(lr), "--warmup-steps", "0", "--weight-decay", "0"]) == 0
    assert load_model(run).config.position == "rope"
    tuned, source = load_model(run).state_dict(), load_model(tmp_path / "hf").state_dict()
    assert tuned.keys() == source.keys()
    moved = torch.cat([(tuned[k] - source[k]).abs().flatten() for k in source])
    assert moved.max() <= 1.01 * lr and (moved > 0.5 * lr).float().mean() > 0.5  # one step
