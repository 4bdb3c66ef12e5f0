"""A training step's anatomy: its time beside the time of its products alone.

One step of a real `tlm train` run (built by `open_run` from the recipe's flags) is recorded
op by op (a `TorchDispatchMode` sees every aten call after autocast, so bf16 products are
seen as bf16). Its matrix products (mm, addmm, bmm, baddbmm: the model's, its gradients' and
Muon's) and its attention kernels are then replayed alone, on random tensors of the same
shapes, strides and dtypes. Whatever a step takes beyond them is what can be cut without
faster kernels: elementwise work, casts, the optimizer's updates, Python and dispatch.
"""

from __future__ import annotations

import resource
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import tlm.train.attention_kernel  # noqa: F401  (registers torch.ops.tlm.causal_attention)

aten = torch.ops.aten
PRODUCTS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}
ATTENTION = {  # PyTorch's kernel, and tlm's (bf16 training on a CPU with AVX512_BF16)
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    torch.ops.tlm.causal_attention.default,
    torch.ops.tlm.causal_attention_backward.default,
}


class Layout(NamedTuple):
    """A recorded tensor argument: what a fresh one needs to be like it."""

    size: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype

    def fresh(self) -> torch.Tensor:
        t = torch.empty_strided(self.size, self.stride, dtype=self.dtype)
        return t.normal_() if self.dtype.is_floating_point else t.zero_()


@dataclass
class Call:
    """One recorded aten call: the op and its arguments, each tensor as its `Layout`."""

    op: torch._ops.OpOverload
    args: tuple
    kwargs: dict

    def replay_args(self) -> tuple[tuple, dict]:
        """The arguments again, each tensor a fresh random one of the same layout."""
        fresh = lambda a: a.fresh() if isinstance(a, Layout) else a  # noqa: E731
        return tuple(map(fresh, self.args)), {k: fresh(v) for k, v in self.kwargs.items()}


class Recorder(TorchDispatchMode):
    """Records the calls of `ops` (their tensors as `Layout`s) and counts all."""

    def __init__(self, ops: set) -> None:
        super().__init__()
        self.ops, self.calls, self.count = ops, [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.count += 1
        if func in self.ops:
            kept = {k: _layout(v) for k, v in kwargs.items()}
            self.calls.append(Call(func, tuple(map(_layout, args)), kept))
        return func(*args, **kwargs)


def _layout(a):
    return Layout(a.shape, a.stride(), a.dtype) if torch.is_tensor(a) else a


def replay(calls: list[Call], repeats: int = 5) -> float:
    """Seconds the calls take alone, one after another (median of `repeats`)."""
    prepared = [(c.op, *c.replay_args()) for c in calls]
    for op, args, kwargs in prepared:  # warm up
        op(*args, **kwargs)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        for op, args, kwargs in prepared:
            op(*args, **kwargs)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def trainer_for(flags: str, data: Path, out: Path):
    """A `Trainer` for `tlm train --data DATA --out OUT <flags>` (OUT must not exist)."""
    from tlm.cli import build_parser
    from tlm.cli.args import config_overrides
    from tlm.config import ModelConfig, TrainConfig
    from tlm.tokenizer import load_tokenizer
    from tlm.train import new_run_configs, open_run

    argv = ["train", "--data", str(data), "--out", str(out), *flags.split()]
    args = build_parser().parse_args(argv)
    model_config, train_config, source = new_run_configs(
        config_overrides(args, ModelConfig), config_overrides(args, TrainConfig)
    )
    tokenizer = load_tokenizer(source.folder).to_json()
    return open_run(model_config, train_config, source, tokenizer, progress_bar=False)


def anatomy(trainer, steps: int, first: int = 3) -> dict[str, float]:
    """Seconds a step takes (median over `steps`, after `first` warm-up steps), split into
    forward + backward (with the batch) and the update (clipping and the optimizer), beside
    its products and its attention replayed alone; and the aten calls and page faults
    (minor: a fresh page from the kernel) a step makes."""
    for step in range(first):
        trainer.train_step(step)
    whole, passes = [], []
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for step in range(first, first + steps):
        started = time.perf_counter()
        loss = trainer.batches.step_loss(trainer, step)
        middle = time.perf_counter()
        trainer.update(step, loss)
        whole.append(time.perf_counter() - started)
        passes.append(middle - started)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    with Recorder(PRODUCTS | ATTENTION) as recorder:
        trainer.train_step(first + steps)
    step_s, passes_s = statistics.median(whole), statistics.median(passes)
    return {
        "step": step_s,
        "passes": passes_s,
        "update": step_s - passes_s,
        "products": replay([c for c in recorder.calls if c.op in PRODUCTS]),
        "attention": replay([c for c in recorder.calls if c.op in ATTENTION]),
        "calls": recorder.count,
        "faults": faults / steps,
    }


def describe(name: str, precision: str, parts: dict[str, float]) -> str:
    """One line: the step, its products' and attention's share, the rest."""
    step = parts["step"]
    rest = step - parts["products"] - parts["attention"]
    ms = lambda s: f"{s * 1e3:.1f} ms"  # noqa: E731
    return (
        f"{name} ({precision}): step {ms(step)} = products alone {ms(parts['products'])} "
        f"({parts['products'] / step:.0%}) + attention alone {ms(parts['attention'])} "
        f"({parts['attention'] / step:.0%}) + the rest {ms(rest)} ({rest / step:.0%}); "
        f"forward+backward {ms(parts['passes'])}, update {ms(parts['update'])}, "
        f"{parts['calls']:,} aten calls and {parts['faults']:,.0f} page faults a step"
    )
