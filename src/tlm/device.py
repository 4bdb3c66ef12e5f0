"""Which device a command runs on, and where a model is: the one place for both.

Every command that runs a model, and training, takes `--device auto|cpu|cuda[:N]`;
`auto` is the first CUDA GPU where PyTorch sees one and the weight format runs there, else
the CPU, as training always chose. A device that is not there is refused in one line.
Once a model is on its device, the code that runs it takes the device and dtype from the
model (`placement`): ids handed in are moved there once, and everything made is made there.
"""

from __future__ import annotations

import torch

from tlm.errors import UserError

CPU_ONLY = ("int8", "q8_0", "q4_0", "q4_k")  # formats whose kernels are tlm's C, for x86 CPUs


class DeviceError(UserError):
    """A device asked for that this machine does not have."""


def pick_device(name: str = "auto", dtype: str | None = None) -> torch.device:
    """`name` ("auto", "cpu", "cuda", "cuda:N") as a torch device on this machine; `dtype`
    is the weight format the model will be read in (an int8 model runs on the CPU: `auto`
    picks it there, and an explicit GPU is refused when the model is read)."""
    if name == "auto":
        gpu = torch.cuda.is_available() and dtype not in CPU_ONLY
        return torch.device("cuda" if gpu else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise DeviceError(f"--device must be auto, cpu, cuda or cuda:N; got {name!r}") from None
    if device.type not in ("cpu", "cuda", "mps"):
        raise DeviceError(f"--device must be auto, cpu, cuda or cuda:N; got {name!r}")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise DeviceError("device mps was asked for, but PyTorch sees no Apple GPU here")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise DeviceError(f"device {name} was asked for, but no CUDA device is available")
        if (device.index or 0) >= count:
            raise DeviceError(f"device {name} was asked for; this machine has {count} GPU(s)")
    return device


def placement(model: torch.nn.Module) -> tuple[torch.device, torch.dtype]:
    """(device, dtype) of a model's weights: where the code that runs it puts every tensor
    it makes, and what a decoding cache keeps."""
    weight = next(model.parameters())
    return weight.device, weight.dtype


def describe(device: torch.device) -> str:
    """The device as a command's first line names it: `cuda:0 (NVIDIA H200)`, `cpu`."""
    if device.type != "cuda":
        return str(device)
    index = device.index or 0
    return f"cuda:{index} ({torch.cuda.get_device_name(index)})"
