"""Decoding over a static cache (inference/devices/cuda_graph.py): the same tokens as the reference.

The cache runs eagerly on a CPU, so its arithmetic is held equal to the uncached model here;
the tests marked `cuda` record and replay the step as a CUDA graph, and skip without a GPU.
"""

import pytest
import torch

from conftest import POSITIONS
from tlm.generate import GenerationConfig, generate
from tlm.generate.decode import GraphedState, _decode
from tlm.inference import Decoder
from tlm.inference.devices.cuda_graph import GraphedDecoder, StaticCache
from tlm.model.attention import padding_mask

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def varied(model):
    """Weights of std 0.3: greedy tokens that change from step to step (test_decode.py)."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(1.0 if name.endswith("gamma") else 0.0, 0.3, generator=generator)
    return model


def tokens_of(steps):
    steps = list(steps)
    return torch.stack([s.tokens for s in steps], 1), torch.stack([s.logprobs for s in steps], 1)


def static(model, ids, mask, config, capacity=32, graph=False):
    decoder = GraphedDecoder(model, len(ids), capacity, graph=graph)
    return tokens_of(_decode(GraphedState(decoder, ids, mask), config))


def left_padded(ids):
    """Rows 1 and 2 of ids [3,T] lose their first 3 and 5 tokens to left padding."""
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    mask[2, :5] = 0
    return ids.masked_fill(mask == 0, 0), mask


@pytest.mark.parametrize("position", POSITIONS)
def test_static_cache_decodes_as_the_uncached_model_with_left_padding(make_model, position):
    model = varied(make_model(position=position))
    ids, mask = left_padded(
        torch.randint(0, 97, (3, 9), generator=torch.Generator().manual_seed(1))
    )
    config = GenerationConfig(max_new_tokens=14)
    ours, our_lp = static(model, ids, mask, config)
    reference, reference_lp = tokens_of(
        generate(model, ids, GenerationConfig(max_new_tokens=14, use_cache=False), mask)
    )
    assert torch.equal(ours, reference)
    assert torch.allclose(our_lp, reference_lp, atol=1e-4)
    assert len(set(ours.flatten().tolist())) >= 6  # the argmax does move
    for row, keep in enumerate(mask.bool()):  # each row as if it had been alone
        alone, _ = static(model, ids[row : row + 1, keep], None, config)
        assert torch.equal(alone[0], ours[row])


def test_a_prompts_mask_is_the_models_padding_mask_over_the_written_columns(make_model):
    ids, mask = left_padded(torch.randint(0, 97, (3, 9)))
    cache = StaticCache(make_model().config, 3, 16, torch.float32, torch.device("cpu"))
    cache.start(mask, 9)
    positions = cache.positions(9, torch.device("cpu"))
    assert torch.equal(positions, (mask.cumsum(-1) - 1).clamp(min=0))  # as TransformerLM's
    assert torch.equal(cache.visible[..., :9], padding_mask(9, mask))
    assert not cache.visible[..., 9:].any()  # columns not yet written


def test_static_cache_samples_as_the_reference_loop(make_model):
    model = varied(make_model(position="rope"))
    ids = torch.randint(0, 97, (4, 6), generator=torch.Generator().manual_seed(3))
    settings = dict(max_new_tokens=10, do_sample=True, top_p=0.9, seed=11, repetition_penalty=1.3)
    ours, _ = static(model, ids, None, GenerationConfig(**settings))
    reference, _ = tokens_of(generate(model, ids, GenerationConfig(use_cache=False, **settings)))
    assert torch.equal(ours, reference)


def test_what_is_not_graphed(make_model):
    model = make_model()
    assert not Decoder(model).graphable(4, 8)  # a CPU model: the slot path
    on_gpu = torch.device("cuda") if torch.cuda.is_available() else None
    if on_gpu is None:
        return
    model = model.to(on_gpu)
    decoder = Decoder(model)
    assert decoder.graphable(4, 8)
    assert not decoder.graphable(4, model.config.context_length)  # the window would slide
    handle = model.blocks[0].attn.pattern.register_forward_hook(lambda m, i, o: None)
    assert not decoder.graphable(4, 8)  # a hook would run once, at recording
    handle.remove()
    model.train()
    assert not decoder.graphable(4, 8)  # dropout would draw one mask for every step


def test_one_recording_is_kept_per_decoder_for_windows_of_256(make_model):
    model = make_model(context_length=600)
    decoder = Decoder(model)
    first = decoder.graphed(2, 40)
    assert first.cache.capacity == 256  # 40 positions, rounded up
    assert decoder.graphed(2, 200) is first  # the same window: replayed
    wider = decoder.graphed(2, 300)
    assert wider is not first and wider.cache.capacity == 512
    assert decoder.graphed(2, 590).cache.capacity == 600  # at most the context
    assert decoder.graphed(3, 40) is not decoder.graphed(2, 40)
    before = decoder.graphed(2, 40)
    assert decoder.graphed(2, 40) is before
    assert Decoder(model).graphed(2, 40) is not before  # another decoder records its own
    W_Q = model.blocks[0].attn.W_Q
    W_Q.data = W_Q.data.clone()  # moved: a recording would read the old address
    assert decoder.graphed(2, 40) is not before


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_replays_decode_as_the_slot_path(make_model, dtype):
    model = varied(make_model(position="rope")).to("cuda", dtype)
    ids, mask = left_padded(
        torch.randint(0, 97, (3, 9), generator=torch.Generator().manual_seed(1))
    )
    ids, mask, decoder = ids.cuda(), mask.cuda(), Decoder(model)
    for new in (14, 20):  # the second call replays the first one's recording
        config = GenerationConfig(max_new_tokens=new)
        graphed, _ = tokens_of(generate(model, ids, config, mask, decoder=decoder))
        eager, _ = tokens_of(
            generate(model, ids, GenerationConfig(max_new_tokens=new, cuda_graph=False), mask)
        )
        assert torch.equal(graphed, eager)
    graphed = decoder.graphed(3, 9 + 20)
    assert graphed.graph is not None and graphed.cache.filled == 9 + 20 - 1


@cuda
def test_a_graph_that_cannot_be_recorded_decodes_step_by_step(make_model, monkeypatch, capsys):
    model = varied(make_model()).cuda()
    ids = torch.randint(0, 97, (2, 5), device="cuda")

    def refuse():
        raise RuntimeError("capture refused")

    monkeypatch.setattr(torch.cuda, "CUDAGraph", refuse)
    decoder = GraphedDecoder(model, 2, 32, graph=True)
    ours, _ = tokens_of(
        _decode(GraphedState(decoder, ids, None), GenerationConfig(max_new_tokens=8))
    )
    reference, _ = tokens_of(
        generate(model, ids, GenerationConfig(max_new_tokens=8, use_cache=False))
    )
    assert torch.equal(ours, reference)
    assert capsys.readouterr().err.count("CUDA graph not recorded (capture refused)") == 1
