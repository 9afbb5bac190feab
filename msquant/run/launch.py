"""Starting the processes of a ``dp_layer_wise`` group through ``torch.distributed``: gloo on CPUs,
NCCL on CUDA GPUs, HCCL on Ascend NPUs.

Launch with ``torchrun --nproc_per_node N msquant quant ...`` (any rendezvous torchrun supports,
several nodes included), or let :func:`spawn` start the processes for a multi-device ``--device``;
:func:`from_environment` joins the group the environment describes. What the processes then
exchange: :mod:`msquant.contracts.distributed`.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from msquant.contracts.distributed import SINGLE, Distributed

__all__ = ["BACKEND_BY_DEVICE", "from_environment", "spawn"]

logger = logging.getLogger(__name__)


# torch.distributed backend per device kind.
BACKEND_BY_DEVICE = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


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
