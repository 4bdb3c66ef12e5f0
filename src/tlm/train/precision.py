"""The training precision: fp32, or bf16 autocast where the hardware multiplies bf16 itself.

`--precision auto` (the default) trains in bf16 autocast on a CUDA device and on a CPU with its
own bf16 units (AVX512_BF16 or AMX, as PyTorch finds them at run time), in fp32 elsewhere.
Autocast keeps the weights, the optimizer and the loss in fp32 and runs the products in
bf16: on a CPU with AVX512_BF16 a 4096×768 by 768×3072 product runs 2.1-2.5× (this
project's AVX-512 EPYC hosts) to 4.2× (a Zen 5) faster than in fp32; attention runs in
tlm's own kernel there (`train/attention_kernel.py`: bf16 products adding in fp32, 2.4×
PyTorch's fp32 kernel), which `open_run` sets. On a CPU without such units a bf16 product
is emulated (1 GFLOP/s against 91 in fp32 on an AVX2 host), so there `--precision bfloat16` is
refused in one line instead of training 20× slower without a word. Muon's Newton–Schulz
iteration runs in the same precision.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tlm.config import ConfigError

NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


@dataclass(frozen=True)
class Precision:
    """What the products of a training step compute in, and why."""

    dtype: torch.dtype
    why: str

    @property
    def name(self) -> str:
        return NAMES[self.dtype]

    def __str__(self) -> str:
        kind = "bf16 autocast" if self.dtype == torch.bfloat16 else "fp32"
        return f"{kind}: {self.why}"

    def to_dict(self) -> dict[str, str]:
        return {"dtype": self.name, "why": self.why}


def bf16_units() -> str | None:
    """The CPU's own bf16 arithmetic, "AMX" or "AVX512_BF16", or None: bf16 is emulated.
    None too where PyTorch's kernels are held below AVX-512 (`ATEN_CPU_CAPABILITY=avx2`,
    how an AVX-512 host runs as an AVX2-only one, for tests and benchmarks)."""
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        return None
    cpu = torch.cpu
    if getattr(cpu, "_is_amx_tile_supported", lambda: False)():
        return "AMX"
    if getattr(cpu, "_is_avx512_bf16_supported", lambda: False)():
        return "AVX512_BF16"
    return None


def pick_precision(name: str, device: torch.device) -> Precision:
    """The precision of `--precision NAME` (auto, float32, bfloat16) on `device`."""
    if name == "float32":
        return Precision(torch.float32, "as asked (--precision float32)")
    if device.type == "cuda":
        why = "as asked" if name == "bfloat16" else "the default on a GPU"
        return Precision(torch.bfloat16, why)
    units = bf16_units() if device.type == "cpu" else None
    if name == "bfloat16":
        if device.type == "cpu" and units is None:
            raise ConfigError(
                "--precision bfloat16: this CPU has no bf16 units (no AVX512_BF16 or AMX), so "
                "every bf16 product is emulated, 20x or more slower than fp32; use --precision "
                "auto or float32"
            )
        return Precision(torch.bfloat16, f"as asked, on {units or device.type}")
    if units is not None:
        return Precision(torch.bfloat16, f"the CPU multiplies bf16 natively ({units})")
    if device.type == "cpu":
        return Precision(torch.float32, "the CPU has no bf16 units (no AVX512_BF16 or AMX)")
    return Precision(torch.float32, f"the default on {device.type}")
