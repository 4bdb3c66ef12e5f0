"""The departures from the book for small budgets: ReLU², QK-norm and Muon (issue 16).
Each is an option whose default stays the textbook's."""

import json

import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_config, written_out
from tlm.checkpoint import load_checkpoint, save_checkpoint
from tlm.cli import main
from tlm.config import TrainConfig
from tlm.model import TransformerLM
from tlm.model.functional import ACTIVATIONS
from tlm.model.kv_cache import KVCache
from tlm.train import RunError, Runtime, new_run_configs, open_run
from tlm.train.muon import Muon, orthogonalize
from tlm.train.optim import Combined, build_optimizer


def test_relu2_is_relu_squared():
    x = torch.linspace(-3, 3, 61)
    assert torch.equal(ACTIVATIONS["relu2"](x), torch.where(x > 0, x * x, torch.zeros_like(x)))


def make(**overrides) -> TransformerLM:
    torch.manual_seed(0)
    model = TransformerLM(tiny_config(**overrides)).eval()
    for p in model.parameters():  # weights large enough that the norm changes the logits
        torch.nn.init.normal_(p, std=0.3)
    return model


@pytest.mark.parametrize("position", ["learned", "rope"])
def test_qk_norm_puts_each_head_at_unit_rms_and_both_paths_agree(position):
    model, ids = make(qk_norm=True, position=position), torch.randint(0, 97, (2, 11))
    seen = {}
    attn = model.blocks[0].attn
    attn.q.register_forward_hook(lambda m, i, o: seen.setdefault("q", o))
    attn.k.register_forward_hook(lambda m, i, o: seen.setdefault("k", o))
    with torch.no_grad():
        fused = model(ids)
        written = written_out(make(qk_norm=True, position=position))(ids)
        plain = make(position=position)(ids)
    for t in (seen["q"], seen["k"]):  # [B,H,T,d_head]; rotary keeps each pair's norm
        assert torch.allclose(t.pow(2).mean(-1), torch.ones(()), atol=1e-4)
    assert torch.allclose(fused, written, atol=1e-5)
    assert not torch.allclose(fused, plain, atol=1e-2)  # the norm is applied, not skipped


def test_qk_norm_cached_equals_uncached():
    model, ids = (
        make(qk_norm=True, position="rope", activation="relu2"),
        torch.randint(0, 97, (2, 12)),
    )
    with torch.no_grad():
        whole, cache = model(ids), KVCache(model.config, 2)
        stepped = torch.cat(
            [model(ids[:, :7], cache), model(ids[:, 7:9], cache), model(ids[:, 9:], cache)], 1
        )
    assert torch.allclose(whole, stepped, atol=1e-5)
    assert torch.equal(
        model.generate(ids[:, :4], max_new_tokens=8),
        model.generate(ids[:, :4], max_new_tokens=8, use_cache=False),
    )


def test_muon_takes_the_blocks_matrices_and_adamw_the_rest():
    model = TransformerLM(tiny_config(position="learned", bias=True, tie_embeddings=False))
    optimizer = build_optimizer(model, TrainConfig(optimizer="muon"))
    muon, adamw = optimizer.optimizers
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    names = {id(p): n for n, p in model.named_parameters()}
    in_muon = {names[id(p)].rsplit(".", 1)[-1] for g in muon.param_groups for p in g["params"]}
    in_adamw = {names[id(p)].rsplit(".", 1)[-1] for g in adamw.param_groups for p in g["params"]}
    assert in_muon == {"W_Q", "W_K", "W_V", "W_O", "W_1", "W_2"}
    assert in_adamw == {"E", "P", "W_U", "gamma", "beta", "b_Q", "b_K", "b_V", "b_O", "b_1", "b_2"}
    counted = sum(len(g["params"]) for g in optimizer.param_groups)
    assert counted == len(list(model.parameters()))  # every parameter, once
    assert isinstance(build_optimizer(model, TrainConfig()), torch.optim.AdamW)  # the default


def step(model, optimizer, seed):
    ids = torch.randint(0, 97, (4, 17), generator=torch.Generator().manual_seed(seed))
    loss = F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def test_muon_state_saves_and_loads_through_a_checkpoint(tmp_path):
    """Three steps, a checkpoint, two more: a run loaded from the checkpoint ends equal."""
    config = TrainConfig(optimizer="muon", lr=0.01)
    torch.manual_seed(0)
    model = TransformerLM(tiny_config())
    optimizer = build_optimizer(model, config)
    for seed in range(3):
        step(model, optimizer, seed)
    save_checkpoint(tmp_path, model, optimizer, {"step": 3})
    for seed in (3, 4):
        step(model, optimizer, seed)
    again = TransformerLM(tiny_config())
    saved = load_checkpoint(tmp_path / "train_state" / "step-000003", again, None)
    resumed = build_optimizer(again, config)
    resumed.load_state_dict(saved["optimizer"])
    for seed in (3, 4):
        step(again, resumed, seed)
    assert all(
        torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters(), strict=True)
    )
    fresh = build_optimizer(TransformerLM(tiny_config()), config)
    assert (
        isinstance(resumed, Combined) and resumed.state_dict().keys() == fresh.state_dict().keys()
    )


@pytest.mark.slow
def test_a_small_budget_run_with_all_three_options_learns(docs_chars, tmp_path):
    """100 steps: the loss falls by 1.22-1.32 over seeds 1337, 1 and 2 (1 and 2 threads
    alike); at 60 steps it fell by 0.94-1.00, on the threshold."""
    args = ["train", "--data", str(docs_chars), "--out", str(tmp_path / "run"), "--quiet"]
    args += ["--n-layers", "2", "--d-model", "32", "--n-heads", "2", "--context-length", "32"]
    args += ["--batch-size", "8", "--max-steps", "100", "--warmup-steps", "5", "--lr", "0.01"]
    args += ["--optimizer", "muon", "--qk-norm", "--activation", "relu2", "--eval-interval", "100"]
    assert main(args) == 0
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    losses = [r["train_loss"] for r in rows if "train_loss" in r]
    assert losses[-1] < losses[0] - 1.0
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["model"]["qk_norm"] is True and saved["train"]["optimizer"] == "muon"


def test_muon_refuses_fsdp(docs_chars, tmp_path):
    model_config, train_config, data = new_run_configs(
        {"n_layers": 1, "d_model": 32, "n_heads": 2, "context_length": 16},
        {"data": str(docs_chars), "out": str(tmp_path / "run"), "optimizer": "muon"},
    )
    runtime = Runtime(0, 1, 0, torch.device("cpu"), fsdp=True)
    with pytest.raises(RunError, match="use DDP, not --fsdp"):
        open_run(model_config, train_config, data, "{}", runtime=runtime)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("adjust", ["original", "match_rms_adamw"])
def test_our_muon_in_bf16_is_torchs_step_for_step(adjust):
    """tlm's Muon only moves Newton-Schulz to fp32 on a CPU; in bf16 it is torch's exactly."""
    torch.manual_seed(0)
    shapes = [(48, 80), (96, 32), (48, 80)]  # wide, tall, and two of one shape (a stack)
    start = [torch.randn(shape) for shape in shapes]
    params = [t.clone().requires_grad_() for t in start]
    copies = [t.clone().requires_grad_() for t in start]
    settings = {"lr": 0.02, "weight_decay": 0.1, "adjust_lr_fn": adjust}
    ours = Muon(params, ns_dtype=torch.bfloat16, **settings)
    reference = torch.optim.Muon(copies, **settings)
    for seed in range(3):
        for group in (params, copies):
            g = torch.Generator().manual_seed(seed)
            for p in group:
                p.grad = torch.randn(p.shape, generator=g)
        ours.step()
        reference.step()
    assert all(torch.equal(a, b) for a, b in zip(params, copies, strict=True))
    fp32 = orthogonalize(torch.randn(64, 128), (3.4445, -4.775, 2.0315), 5, 1e-7, torch.float32)
    singular = torch.linalg.svdvals(fp32)
    assert 0.5 < singular.min() and singular.max() < 1.5  # U S' Vᵀ with S' near 1 (Jordan)


def test_a_stack_is_orthogonalised_as_each_matrix_alone():
    torch.manual_seed(0)
    stack, ns = torch.randn(5, 96, 40), ((3.4445, -4.775, 2.0315), 5, 1e-7, torch.float32)
    alone = torch.stack([orthogonalize(G, *ns) for G in stack])
    assert torch.allclose(orthogonalize(stack, *ns), alone, atol=1e-5)


def test_on_a_cpu_newton_schulz_runs_in_fp32():
    """The reason for tlm's Muon: one step equals the written-out update with fp32 NS."""
    torch.manual_seed(0)
    W = torch.randn(32, 64, requires_grad=True)
    W.grad = torch.randn(32, 64)
    start, grad = W.detach().clone(), W.grad.clone()
    Muon([W], lr=0.02, weight_decay=0.0).step()  # first step: the momentum is (1 - μ) G
    update = grad.lerp((1 - 0.95) * grad, 0.95)  # Nesterov: G + μ (M - G)
    ns = orthogonalize(update, (3.4445, -4.775, 2.0315), 5, 1e-7, torch.float32)
    assert torch.allclose(W.detach(), start - 0.02 * ns, atol=1e-6)  # lr · √max(1, 32/64)
