"""Training on several processes, with PyTorch's own engine (J&M §10.9; nanoGPT's DDP).

`torchrun --nproc_per_node=K -m tlm train ...` starts K copies of `tlm train`, each with
RANK, LOCAL_RANK and WORLD_SIZE in its environment. `Runtime.from_env()` reads them, joins
the process group (`gloo` on CPU, `nccl` on CUDA) and tells the trainer who it is:

- every rank holds the model and draws its own slice of each global batch;
- `wrap(model)` is DistributedDataParallel, which averages the gradients over the ranks
  during backward (or FSDP2's `fully_shard` with `fsdp=True`, which also shards the
  parameters, gradients and optimizer state);
- `sync(model, last)` skips that averaging on every micro-batch of a step but its last;
- only the main rank (rank 0) writes files, and losses are averaged over the ranks before
  anyone logs or judges them, so that every rank stops, saves or goes on together.

On one process (no torchrun) the runtime is a no-op: nothing is wrapped or reduced.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from tlm.device import pick_device
from tlm.train.run import RunError


@dataclass
class Runtime:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    fsdp: bool = False

    @classmethod
    def from_env(cls, device: str = "auto", fsdp: bool = False, timeout_s: int = 600) -> Runtime:
        """The runtime torchrun describes in the environment, or a single process."""
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        chosen = pick_device(device)
        if world_size == 1:
            if fsdp:
                raise RunError(
                    "--fsdp shards a model over several processes; start them with "
                    "torchrun --nproc_per_node=K -m tlm train ..."
                )
            return cls(device=chosen)
        rank, local_rank = _env_rank("RANK", world_size), _env_rank("LOCAL_RANK", world_size)
        if chosen.type == "cuda":
            chosen = torch.device("cuda", local_rank)
            torch.cuda.set_device(chosen)
        backend = "nccl" if chosen.type == "cuda" else "gloo"
        try:
            dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
        except dist.DistError as exc:  # torchrun's agent met the others; this rank did not
            where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
            first = str(exc).strip().splitlines()[0]
            raise RunError(
                f"rank {rank} of {world_size} could not join at {where}: {first}"
            ) from None
        return cls(rank, world_size, local_rank, chosen, fsdp)

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def all_reduce_mean(self, value: float) -> float:
        """The mean of `value` over the ranks (`value` itself on one process)."""
        if not self.distributed:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self._comm_device)
        dist.all_reduce(t)
        return t.item() / self.world_size

    def any(self, flag: bool) -> bool:
        """True on every rank if it is true on any (a Ctrl-C, a failed save)."""
        if not self.distributed:
            return flag
        t = torch.tensor([float(flag)], device=self._comm_device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def wrap(self, model: nn.Module) -> nn.Module:
        """The module the trainer calls: DDP, FSDP2 (in place), or the model itself."""
        if not self.distributed:
            return model
        if self.fsdp:
            from torch.distributed.fsdp import fully_shard

            for block in model.blocks:  # one unit per block, then the rest (embeddings, head)
                fully_shard(block)
            fully_shard(model)
            return model
        ids = [self.device.index] if self.device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=ids)

    def sync(self, wrapped: nn.Module, last: bool):
        """A context for one micro-batch's backward: gradients are averaged over the ranks on
        the step's last micro-batch only (the others only accumulate locally)."""
        if not self.distributed or last:
            if self.fsdp:
                wrapped.set_requires_gradient_sync(True)
            return contextlib.nullcontext()
        if self.fsdp:
            wrapped.set_requires_gradient_sync(False)
            return contextlib.nullcontext()
        return wrapped.no_sync()

    def grad_norm(self, norm: torch.Tensor) -> float:
        """The whole gradient's norm as a number (under FSDP a DTensor to gather)."""
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    def full_weights(self, model: nn.Module) -> dict:
        """The model's whole state dict, for the main rank to save (under FSDP every rank must
        call this: the shards are gathered; the other ranks get an empty dict)."""
        if not self.fsdp:
            return model.state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = StateDictOptions(full_state_dict=True, cpu_offload=True)
        weights = get_model_state_dict(model, options=full)
        return weights if self.is_main else {}

    def full_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
        """The model's and the optimizer's whole state dicts, in one process's form (the
        optimizer's keyed by parameter index), for the main rank to save. Under FSDP every
        rank must call this: the shards are gathered; the other ranks get empty dicts."""
        if not self.fsdp:
            return model.state_dict(), optimizer.state_dict()
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        full = StateDictOptions(full_state_dict=True, cpu_offload=True)
        weights = get_model_state_dict(model, options=full)
        by_name = get_optimizer_state_dict(model, optimizer, options=full)
        if not self.is_main:
            return {}, {}
        index = {name: i for i, name in enumerate(_names(model, optimizer))}
        return weights, {
            "state": {index[name]: value for name, value in by_name["state"].items()},
            "param_groups": [
                {**g, "params": [index[n] for n in g["params"]]} for g in by_name["param_groups"]
            ],
        }

    def load_optimizer(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict
    ) -> None:
        """Load a saved optimizer state dict (one process's form) into this optimizer, whose
        state each rank shards under FSDP."""
        if not self.fsdp:
            optimizer.load_state_dict(state)
            return
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_optimizer_state_dict,
        )

        names = _names(model, optimizer)
        by_name = {
            "state": {names[i]: value for i, value in state["state"].items()},
            "param_groups": [
                {**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]
            ],
        }
        options = StateDictOptions(full_state_dict=True)
        set_optimizer_state_dict(model, optimizer, optim_state_dict=by_name, options=options)

    def close(self) -> None:
        if self.distributed and dist.is_initialized():
            dist.destroy_process_group()

    @property
    def _comm_device(self) -> torch.device:
        return self.device if self.device.type == "cuda" else torch.device("cpu")


def _names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The name of each parameter, in the optimizer's order (its index in a state dict)."""
    name_of = {id(param): name for name, param in model.named_parameters()}
    return [name_of[id(param)] for group in optimizer.param_groups for param in group["params"]]


def _env_rank(name: str, world_size: int) -> int:
    """A rank torchrun put in the environment, checked against WORLD_SIZE."""
    value = os.environ.get(name, "")
    if not value.isdigit() or int(value) >= world_size:
        raise RunError(
            f"WORLD_SIZE={world_size} but {name}={value or '(unset)'}: start the processes "
            "with torchrun --nproc_per_node=K -m tlm train ..."
        )
    return int(value)
