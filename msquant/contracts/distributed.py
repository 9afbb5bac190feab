"""This process's place in a ``dp_layer_wise`` group and the collectives the engine and processors
use (``ctx.dist``), through ``torch.distributed``.

Every process runs the same layer-wise loop over its share of the calibration batches, so the
layer forwards and the Hessian products are split between them; the Hessian sums are then added up
with ``all_reduce``, each module's GPTQ solve runs in one process (modules are shared out by cost,
:func:`balanced_owners`) and its result is broadcast to the others. Process 0 alone writes the
export and the report. A process started without a process group is :data:`SINGLE` (rank 0 of
1): nothing is exchanged.

A collective that fails raises :class:`PeerLostError`: with gloo that is how a process learns that
another one of its group died (killed, or failed with its own error), so a checkpointed run keeps
its checkpoints for ``--resume`` instead of treating it as its own failure.

How the group is started: :mod:`msquant.run.launch`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

__all__ = ["T", "PeerLostError", "Distributed", "SINGLE", "balanced_owners"]


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


#: The single-process run: rank 0 of a world of 1 (what a run without ``dp_layer_wise`` gets).
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
