"""The peer a user would pick instead (Hugging Face `transformers`), set up like tlm.

Both sides get the same model shape, the same batches (windows drawn by tlm's seeded
sampler), the same loss, optimizer (fused AdamW, no decay on embeddings, norms or biases),
learning rate and gradient clipping. Only the model code differs.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from tlm import ModelConfig, TransformerLM
from tlm.config import TrainConfig
from tlm.data import batch_generator, random_windows
from tlm.interop.gpt2 import gpt2_config
from tlm.train.optim import build_optimizer

SHAPE = {"n_layers": 4, "n_heads": 4, "d_model": 128, "context_length": 64}
BATCH = 12


def host() -> str:
    """The host in one line: CPU model, cores and the instruction sets that change kernels
    (figures from different hosts compare only through ratios taken in one run)."""
    import os
    import platform

    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model in ("", platform.machine()):
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    wanted = ["avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512_vnni", "avx512_bf16"]
    wanted += ["amx_tile"]
    present = " ".join(flag for flag in wanted if flag in flags) or "flags unknown"
    return f"{model}, {os.cpu_count()} cores, {present}; torch {torch.__version__}; {kernels()}"


def kernels() -> str:
    """Which kernels run: tlm's C build (TLM_NATIVE_ARCH, and its instruction sets; the
    formats it has no kernel for run fbgemm's) and PyTorch's own (ATen's CPU capability,
    ATEN_CPU_CAPABILITY to force one)."""
    from tlm.inference import native

    build, lib = native.arch(), native.library()
    here = "none (no C compiler)" if lib is None else native.kernels(lib)
    products = "blocked" if lib is not None and lib.products_here() & 3 == 3 else "fbgemm"
    return (
        f"tlm kernels {build}: {here}, int8/fp16 products {products}; "
        f"PyTorch {torch.backends.cpu.get_cpu_capability()}"
    )


def matmul_peak(n: int = 4096, repeats: int = 5, dtype: torch.dtype = torch.float32) -> float:
    """Measured FLOP/s of one large square matmul in `dtype` (the best this machine does)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - started)
    return 2 * n**3 / statistics.median(times)


class Runner:
    """Training steps of one model on the shared batches; `steps` returns seconds."""

    def __init__(self, model, optimizer, logits, flops_per_token: int) -> None:
        self.model, self.optimizer, self.logits = model.train(), optimizer, logits
        self.tokens_per_step = BATCH * SHAPE["context_length"]
        self.flops_per_token = flops_per_token

    def steps(self, tokens: np.ndarray, n: int, first_step: int = 0) -> float:
        batches = [
            random_windows(tokens, BATCH, SHAPE["context_length"], batch_generator(0, s))
            for s in range(first_step, first_step + n)
        ]
        started = time.perf_counter()
        for x, y in batches:
            logits = self.logits(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0, foreach=True)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - started


def build_pair(activation: str, vocab_size: int) -> dict[str, Runner]:
    from transformers import GPT2Config, GPT2LMHeadModel

    train = TrainConfig(lr=1e-3, weight_decay=0.1)
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=vocab_size, activation=activation, dropout=0.0, **SHAPE)
    ours = TransformerLM(config)
    theirs = GPT2LMHeadModel(GPT2Config(**{**gpt2_config(config, None), "use_cache": False}))
    assert sum(p.numel() for p in theirs.parameters()) == ours.num_parameters()
    flops = ours.flops_per_token(training=True)  # the same shape: the same FLOPs
    return {
        "tlm": Runner(ours, build_optimizer(ours, train), ours, flops),
        "transformers": Runner(
            theirs,
            torch.optim.AdamW(
                _hf_groups(theirs, train.weight_decay),
                lr=train.lr,
                betas=(train.beta1, train.beta2),
                fused=True,
            ),
            lambda x: theirs(input_ids=x).logits,
            flops,
        ),
    }


def _hf_groups(model, weight_decay: float) -> list[dict]:
    """Decay the weight matrices only, as tlm does (embeddings wte/wpe are not decayed)."""
    decay, keep = [], []
    for name, param in model.named_parameters():
        is_matrix = param.dim() >= 2 and "wte" not in name and "wpe" not in name
        (decay if is_matrix else keep).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": keep, "weight_decay": 0.0}]
