"""Several processes quantizing one model together (the ``dp_layer_wise`` runner) through
``torch.distributed``: gloo on CPUs, NCCL on CUDA GPUs, HCCL on Ascend NPUs.

Every process runs the same layer-wise loop over its share of the calibration batches, so the
layer forwards and the Hessian products are split between them; the Hessian sums are then added up
with ``all_reduce``, each module's GPTQ solve runs in one process (modules are shared out by cost)
and its result is broadcast to the others. Process 0 alone writes the export and the report.

Launch with ``torchrun --nproc_per_node N msquant quant ...`` (any rendezvous torchrun supports,
several nodes included), or let :func:`spawn` start the processes for a multi-device ``--device``.
A process started without a process group is :data:`SINGLE` (rank 0 of 1): nothing is exchanged.

A collective that fails raises :class:`PeerLostError`: with gloo that is how a process learns that
another one of its group died (killed, or failed with its own error), so a checkpointed run keeps
its checkpoints for ``--resume`` instead of treating it as its own failure.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

__all__ = [
    "BACKEND_BY_DEVICE",
    "Distributed",
    "PeerLostError",
    "SINGLE",
    "balanced_owners",
    "from_environment",
    "spawn",
]

logger = logging.getLogger(__name__)

# torch.distributed backend per device kind.
BACKEND_BY_DEVICE = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}

T = TypeVar("T")


class PeerLostError(RuntimeError):
    """A collective failed: another process of the ``dp_layer_wise`` group ended (killed, or
    stopped by its own error, which its log shows) or the connection to it broke."""


@contextmanager
def _collective(name: str) -> Iterator[None]:
    """Turn the backend's error of a failed collective into :class:`PeerLostError`."""
    try:
        yield
    except RuntimeError as error:  # gloo: "Connection closed by peer"; DistError subclasses it
        raise PeerLostError(
            f"dp_layer_wise: {name} failed, another process of the group has ended or is "
            f"unreachable (see its log): {error}"
        ) from error


@dataclass(frozen=True)
class Distributed:
    """This process's place in the group and the collectives the engine uses.

    :param rank: this process's index, 0 .. ``world_size - 1``.
    :param world_size: the number of processes.
    :param device: where collective tensors live (the backend's device; CPU for gloo).
    """

    rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        """Whether this process writes the export and the report."""
        return self.rank == 0

    @property
    def active(self) -> bool:
        """Whether there is more than one process."""
        return self.world_size > 1

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over all processes, in place (every process must call this)."""
        if self.active:
            with _collective("all_reduce"):
                dist.all_reduce(tensor, op=dist.ReduceOp.SUM)

    def broadcast_object(self, obj: T, src: int) -> T:
        """``obj`` of process ``src`` on every process (pickled between the group's own
        processes, never read from a file)."""
        if not self.active:
            return obj
        box: list[Any] = [obj if self.rank == src else None]
        with _collective("broadcast"):
            dist.broadcast_object_list(box, src=src, device=self.device)
        return box[0]

    def all_gather_object(self, obj: T) -> list[T]:
        """Every process's ``obj``, by rank, on every process (one small broadcast per process:
        meant for a few bytes of bookkeeping per layer, through the same path as
        :meth:`broadcast_object` on every backend)."""
        return [self.broadcast_object(obj, src) for src in range(self.world_size)]

    def barrier(self) -> None:
        """Wait until every process got here."""
        if self.active:
            with _collective("barrier"):
                dist.barrier()

    def shard(self, items: Sequence[T]) -> list[T]:
        """This process's share of ``items`` (round robin, so shares differ by at most one)."""
        return list(items[self.rank :: self.world_size])


SINGLE = Distributed()


def balanced_owners(costs: Sequence[float], world_size: int) -> list[int]:
    """The process that handles each item: largest cost first, each to the least-loaded
    process (ties to the lowest rank); the same on every process."""
    loads = [0.0] * world_size
    owners = [0] * len(costs)
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        owners[index] = rank
        loads[rank] += costs[index]
    return owners


def from_environment(device_kind: str, device: torch.device) -> Distributed:
    """The process group torchrun (or :func:`spawn`) describes in the environment, initialised
    here if needed; :data:`SINGLE` when ``WORLD_SIZE`` is unset or 1."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return SINGLE
    if not dist.is_initialized():
        backend = BACKEND_BY_DEVICE[device_kind]
        dist.init_process_group(backend=backend)
        logger.info(
            "dp_layer_wise: process %d of %d (%s)", dist.get_rank(), dist.get_world_size(), backend
        )
    collective_device = device if device_kind != "cpu" else torch.device("cpu")
    return Distributed(dist.get_rank(), dist.get_world_size(), collective_device)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _worker(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: Any) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    try:
        fn(rank, *args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(fn: Callable[..., Any], world_size: int, *args: Any) -> None:
    """Run ``fn(rank, *args)`` in ``world_size`` new processes on this machine, joined as one
    process group (``fn`` and ``args`` must be picklable); an error in any process is raised."""
    import torch.multiprocessing as mp

    mp.start_processes(
        _worker,
        args=(world_size, _free_port(), fn, args),
        nprocs=world_size,
        join=True,
        start_method="spawn",
    )
