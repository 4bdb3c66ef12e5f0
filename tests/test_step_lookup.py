"""The whole decoding step's token lookup (step.c's look_up, program.py's Rows): the rows
the model's own lookup gives, for every way a model keeps them, and its errors."""

import ctypes

import pytest
import torch
from test_native_step import needs_native

from tlm import load_model
from tlm.inference import Decoder, SlotCache, for_decoding, for_inference, native
from tlm.inference.decoding import program as whole_program
from tlm.inference.decoding import step as native_step
from tlm.tensor_files import TensorFileError

pytestmark = pytest.mark.usefixtures("kernel_build")  # each instruction set this host runs


def stored_as(folder, dtype: torch.dtype, seed: int = 0):
    """A run directory whose weights are stored in `dtype`, their values exact in it."""
    from safetensors.torch import load_file, save_file
    from test_load_packed import write_run

    run = write_run(folder, seed=seed)
    weights = load_file(run / "model.safetensors")
    save_file({name: w.to(dtype) for name, w in weights.items()}, run / "model.safetensors")
    return run


def lookups(tmp_path, make_model) -> dict:
    """A model per way its token embeddings are kept: its own fp32 parameter, packed rows
    (float16, bfloat16, int8 with a scale per row), and rows left in the file (F32, F16,
    BF16); fp16 rows hold subnormals, infinities and a NaN, which look_up widens itself."""
    made = {"parameters": for_decoding(make_model())}
    made |= {f"packed {fmt}": for_inference(make_model(), fmt) for fmt in ("float16", "bfloat16")}
    made["packed int8"] = for_inference(make_model(), "int8")
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        run = stored_as(tmp_path / str(dtype), dtype)
        if dtype == torch.float16:
            from safetensors.torch import load_file, save_file

            weights = load_file(run / "model.safetensors")
            E = weights["embedding.E"]
            E[1, :4] = torch.tensor([6e-8, -3e-5, float("inf"), float("-inf")])
            E[2, :3] = torch.tensor([float("nan"), 0.0, -0.0])
            save_file(weights, run / "model.safetensors")
        made[f"file {dtype}"] = load_model(run, dtype="int8")
    return made


@needs_native
def test_the_step_looks_up_tokens_as_the_model_does(tmp_path, make_model):
    """step.c's look_up (the whole step's E[w], times the embedding's scale) == the
    model's own lookup, for every way the rows are kept."""
    ids = torch.tensor([1, 2, 96, 0, 1])
    for name, model in lookups(tmp_path, make_model).items():
        model.embedding.scale = 1.5
        rows, lookup = whole_program._rows(model.embedding, [])
        assert rows is not None and lookup is getattr(model.embedding, "lookup", None), name
        x = torch.empty(len(ids), model.config.d_model)
        failed = native.library().look_up(
            ctypes.addressof(rows), ids.data_ptr(), len(ids), x.shape[1], x.data_ptr()
        )
        assert failed == 0
        expected = native_step.looked_up(model, ids)
        torch.testing.assert_close(x, expected, rtol=1e-6, atol=0, equal_nan=True, msg=name)


@needs_native
def test_a_bad_token_or_a_cut_file_fails_the_step_and_moves_nothing(tmp_path):
    from test_load_packed import write_run

    run = write_run(tmp_path / "run")
    model = load_model(run, dtype="int8")
    cache = SlotCache(model.config, 2, capacity=16)
    with torch.no_grad():
        model(torch.randint(0, 97, (1, 3)), cache.feed([0], [3]))
    decoder = Decoder(model)
    with pytest.raises(IndexError, match=r"\[0, 97\)"):
        decoder.slot_step(cache, [0], [97])
    assert cache.lengths == [3, 0]
    first, _ = decoder.slot_step(cache, [0], [5])
    assert cache.lengths == [4, 0] and torch.isfinite(first).all()
    data = (run / "model.safetensors").read_bytes()
    (run / "model.safetensors").write_bytes(data[: 8 + int.from_bytes(data[:8], "little")])
    with pytest.raises(TensorFileError, match="shorter than its header"):
        decoder.slot_step(cache, [0], [5])
    assert cache.lengths == [4, 0]


@needs_native
def test_a_replaced_lookup_is_described_anew(make_model):
    """The whole step reads the lookup the model has now, not the one it was described
    with."""
    model = for_inference(make_model(), "int8")
    ids = torch.tensor([[4, 9]])
    before = model.generate(ids, max_new_tokens=3)
    other = for_inference(make_model(seed=1), "int8").embedding.lookup
    model.embedding.lookup = other
    after = model.generate(ids, max_new_tokens=3)
    native.library, real = (lambda: None), native.library
    try:
        expected = model.generate(ids, max_new_tokens=3)  # the forward pass, no C step
    finally:
        native.library = real
    assert torch.equal(after, expected) and not torch.equal(after, before)
