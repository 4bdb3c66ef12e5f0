"""`load_model(path, dtype=...)`: a model read one part at a time and packed as it comes,
equal to the plain model within each format's error and to `for_inference` product by
product, without ever holding more than one part's fp32 weights."""

import os
import weakref

import pytest
import torch
from test_kv_cache import FORMAT_ERROR

from conftest import hf_model, tiny_config
from tlm import TransformerLM, load_model
from tlm.checkpoint import CheckpointError, save_weights, write_config
from tlm.inference import for_inference
from tlm.inference.formats import blocked, kernels, prepare, q4
from tlm.tensor_files import FileRows, LazyMatrix, TensorFileError, TensorFiles

pytestmark = pytest.mark.usefixtures("kernel_build")  # each instruction set this host runs

FORMATS = list(FORMAT_ERROR)


def write_run(folder, seed=0, **overrides):
    """A run directory of a random model whose weights are of a trained model's size (the
    setting FORMAT_ERROR was measured on)."""
    torch.manual_seed(seed)
    model = TransformerLM(tiny_config(**overrides)).eval()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.1)
    folder.mkdir(parents=True, exist_ok=True)
    save_weights(folder / "model.safetensors", model)
    write_config(folder, model.config, {})
    return folder


@pytest.fixture
def small_head_blocks(monkeypatch):
    """Head blocks (float16) and chunks (int8, bfloat16) of 16 vocabulary rows, so that a
    tiny head is read in several."""
    monkeypatch.setattr(prepare, "HEAD_ROWS", 16)
    monkeypatch.setattr(kernels, "CHUNK", 16)
    monkeypatch.setattr(blocked, "ROWS", 16)
    monkeypatch.setattr(q4, "CHUNK", 16)


@pytest.mark.parametrize("dtype", FORMATS)
@pytest.mark.parametrize("tie", [True, False])
def test_streamed_equals_the_plain_model_within_the_format(tmp_path, dtype, tie, small_head_blocks):
    run = write_run(tmp_path / "run", tie_embeddings=tie, position="rope")
    ids = torch.randint(0, 97, (2, 12))
    plain, streamed = load_model(run), load_model(run, dtype=dtype)
    assert streamed.inference_format == dtype
    with torch.no_grad():
        expected = plain(ids).log_softmax(-1)
        got = streamed(ids).float().log_softmax(-1)
    least, most = FORMAT_ERROR[dtype]
    assert least <= (got - expected).abs().max().item() <= most
    cached = streamed.generate(ids[:, :4], max_new_tokens=6)  # the fast path: cache, slots
    assert torch.equal(cached, streamed.generate(ids[:, :4], max_new_tokens=6, use_cache=False))
    with pytest.raises(RuntimeError, match="built for inference"):
        streamed.train()


@pytest.mark.parametrize(
    "dtype, route",
    [("float16", "own"), ("bfloat16", "own"), ("int8", "own"), ("float16", "torch")]
    + [("int8", "torch"), ("q8_0", "own"), ("q4_0", "own")],
)
def test_each_product_is_the_one_for_inference_makes(
    tmp_path, monkeypatch, dtype, route, small_head_blocks
):
    """Blocks and head: the same packed products as packing the loaded model; the token
    lookup reads E's rows from the file exactly (for_inference keeps them in the format), but
    in q8_0 (also q4's) it keeps Q8_0 rows, made from the file as for_inference makes them.
    With `route="torch"`, tlm's own blocked kernels are switched off (fbgemm's run)."""
    if route == "torch":
        monkeypatch.setattr(blocked, "here", lambda fmt: False)
    run = write_run(tmp_path / "run")
    streamed, packed_model = load_model(run, dtype=dtype), for_inference(load_model(run), dtype)
    E = load_model(run).embedding.E.detach()
    x, ids = torch.randn(3, 64), torch.tensor([[0, 96, 5], [7, 7, 1]])
    for mine, theirs in zip(streamed.blocks, packed_model.blocks, strict=True):
        for name in ("project_qkv", "project_out"):
            a, b = getattr(mine.attn, name)(x), getattr(theirs.attn, name)(x)
            for got, expected in zip(
                a if isinstance(a, tuple) else [a], b if isinstance(b, tuple) else [b], strict=True
            ):
                assert torch.allclose(got, expected, atol=1e-6)
        assert torch.allclose(
            mine.ffn.down(mine.ffn.up(x)), theirs.ffn.down(theirs.ffn.up(x)), atol=1e-6
        )
    if dtype == "float16" and not blocked.here(dtype):  # fbgemm packs whole matrices only
        assert len(streamed.head.blocks) == 7  # 97 rows in blocks of 16
    else:  # one product, read a chunk of rows at a time
        assert isinstance(streamed.head, kernels.PackedLinear)
    assert torch.allclose(streamed.unembed(x), packed_model.unembed(x), atol=1e-5)
    if kernels.wider(dtype) == "q8_0":  # rows of Q8_0 blocks, as llama.cpp's lookups
        assert torch.equal(streamed.embedding.tokens(ids), packed_model.embedding.tokens(ids))
        assert not torch.equal(streamed.embedding.tokens(ids), E[ids])
    else:
        assert torch.equal(streamed.embedding.tokens(ids), E[ids])


@pytest.mark.parametrize("files", ["one", "shards", "bin"])
def test_a_hugging_face_directory_streams_too(tmp_path, small_head_blocks, files):
    """One safetensors file, shards (E looked up in its own shard), or the older
    pytorch_model.bin (read whole: streaming needs safetensors)."""
    hf = hf_model()
    hf.save_pretrained(
        tmp_path / "gpt2", **({"max_shard_size": "20KB"} if files == "shards" else {})
    )
    if files == "bin":
        (tmp_path / "gpt2" / "model.safetensors").unlink()
        torch.save(hf.state_dict(), tmp_path / "gpt2" / "pytorch_model.bin")
    assert (
        len(list((tmp_path / "gpt2").glob("*.safetensors")))
        == {"one": 1, "shards": 8, "bin": 0}[files]
    )
    ids = torch.randint(0, 300, (1, 10))
    with torch.no_grad():
        expected = hf(ids).logits.log_softmax(-1)
        got = load_model(tmp_path / "gpt2", dtype="float16")(ids).log_softmax(-1)
        exact = load_model(tmp_path / "gpt2", dtype="float32")(ids).log_softmax(-1)
    assert (got - expected).abs().max().item() <= FORMAT_ERROR["float16"][1]
    assert (exact - expected).abs().max().item() <= 1e-5


@pytest.mark.parametrize("dtype", ["int8", "float16", "q4_0"])
def test_no_more_than_one_part_is_ever_held_in_fp32(
    tmp_path, monkeypatch, small_head_blocks, dtype
):
    """Every tensor the loader reads is tracked until it is freed: at no moment are the fp32
    weights of more than one part (one product of a block) alive, and E is read a block
    of rows at a time, never whole."""
    run = write_run(tmp_path / "run", n_layers=4)
    alive, most, reads = [0], [0], []

    def track(tensor):
        alive[0] += tensor.nbytes
        most[0] = max(most[0], alive[0])
        weakref.finalize(tensor, lambda n=tensor.nbytes: alive.__setitem__(0, alive[0] - n))
        reads.append(tensor.shape)
        return tensor

    getitem, rows = TensorFiles.__getitem__, LazyMatrix.rows
    monkeypatch.setattr(TensorFiles, "__getitem__", lambda self, n: track(getitem(self, n)))
    monkeypatch.setattr(LazyMatrix, "rows", lambda self, lo, hi: track(rows(self, lo, hi)))
    model = load_model(run, dtype=dtype)
    config = model.config
    up = 4 * (config.d_model * config.d_ff + config.d_ff)  # W_1 and b_1: the largest product
    W_2 = 4 * config.d_ff * config.d_model  # read before `up` is packed, to see `up` end
    whole = sum(4 * p.numel() for p in TransformerLM(config, init=False).parameters())
    assert up <= most[0] <= up + W_2  # one product, and the next one's first matrix
    assert most[0] < whole / 6
    assert (config.vocab_size, config.d_model) not in reads  # E never whole
    assert (
        sum(shape[0] for shape in reads if shape[-1:] == (config.d_model,) and shape[0] <= 16)
        >= config.vocab_size
    )


def test_the_file_rows_outlive_a_replaced_checkpoint(tmp_path):
    """tlm replaces weights by rename: a loaded model keeps reading the rows it was loaded
    with. Ids out of range fail as F.embedding's do."""
    run = write_run(tmp_path / "run")
    model = load_model(run, dtype="int8")
    ids = torch.tensor([[3, 50, 96]])
    before = model.embedding.tokens(ids)
    write_run(tmp_path / "other", seed=1)
    os.replace(tmp_path / "other" / "model.safetensors", run / "model.safetensors")
    assert torch.equal(model.embedding.tokens(ids), before)
    assert not torch.equal(load_model(run).embedding.E[ids], before)
    with pytest.raises(IndexError, match=r"\[0, 97\)"):
        model.embedding.tokens(torch.tensor([[97]]))


def test_a_cut_file_is_a_one_line_error(tmp_path):
    run = write_run(tmp_path / "run")
    rows = FileRows(TensorFiles([run / "model.safetensors"]).lazy("embedding.E"))
    data = (run / "model.safetensors").read_bytes()
    header = 8 + int.from_bytes(data[:8], "little")
    (run / "model.safetensors").write_bytes(data[:header])  # in place: the same file
    with pytest.raises(TensorFileError, match="shorter than its header"):
        rows(torch.arange(97))
    with pytest.raises(CheckpointError, match="cannot read weights"):
        load_model(run, dtype="float16")


def test_weights_that_do_not_fit_and_models_that_cannot_stream(tmp_path):
    run = write_run(tmp_path / "run")
    write_config(run, tiny_config(n_layers=3), {})
    with pytest.raises(CheckpointError, match="does not fit the config: missing"):
        load_model(run, dtype="int8")
    with pytest.raises(CheckpointError, match="has no best.safetensors"):
        load_model(write_run(tmp_path / "ok"), dtype="int8", weights="best")
    with pytest.raises(ValueError, match="dtype must be one of"):
        load_model(run, dtype="int4")
    from tlm.model import EncoderDecoder

    translation = tmp_path / "translation"
    translation.mkdir()
    model = EncoderDecoder(tiny_config(model_type="encoder-decoder"))
    save_weights(translation / "model.safetensors", model)
    write_config(translation, model.config, {})
    with pytest.raises(CheckpointError, match="encoder-decoder"):
        load_model(translation, dtype="float16")


def test_parts_must_come_together(tmp_path):
    """A product is packed once its weights are in: weights that come apart (W_O between
    W_V and b_Q, as a module's own order has them) are refused, and `in_parts` orders them."""
    run = write_run(tmp_path / "run")
    tensors = TensorFiles([run / "model.safetensors"])
    names = list(TransformerLM(tiny_config(), init=False).state_dict())
    with pytest.raises(ValueError, match="come apart"):
        prepare.load_prepared(
            TransformerLM(tiny_config(), init=False), ((n, tensors[n]) for n in names), "int8"
        )
    ordered = prepare.in_parts(names)
    assert sorted(ordered) == sorted(names) and ordered.index("blocks.0.attn.b_Q") < ordered.index(
        "blocks.0.attn.W_O"
    )
