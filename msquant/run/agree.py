"""One outcome for every process of a ``dp_layer_wise`` group: the error one of them hit is raised in
all of them, so that none goes on alone into the next collective.
"""

from __future__ import annotations

from msquant.contracts.distributed import Distributed
from msquant.errors import MsquantInputError
from msquant.run.checkpoint.layout import ResumeError

__all__ = ["agree"]


def agree(dist: Distributed, error: Exception | None) -> None:
    """Raise, in every process of the group, the error one of them hit (the first by rank), so
    that none goes on alone into the next collective; nothing when none did.

    A process raises its own error; the others raise a :class:`ResumeError` with its message
    (a :class:`RuntimeError` for an error that is not about the inputs).
    """
    if not dist.active:
        if error is not None:
            raise error
        return
    mine = None if error is None else (isinstance(error, MsquantInputError), str(error))
    reported = dist.all_gather_object(mine)
    if error is not None:
        raise error
    for rank, entry in enumerate(reported):
        if entry is not None:
            is_input, message = entry
            if is_input:
                raise ResumeError(message)
            raise RuntimeError(f"dp_layer_wise: process {rank} failed: {message}")
