"""Where a checkpointed run keeps its work (the names of the folder and its files), and the error of
a run that cannot be resumed.
"""

from __future__ import annotations

from pathlib import Path

from msquant.errors import MsquantInputError

__all__ = [
    "PARTIAL_SUFFIX",
    "PROGRESS_FILE",
    "PROGRESS_FORMAT",
    "EXPORT_DIR",
    "LAYERS_DIR",
    "HIDDEN_PREFIX",
    "OUTSIDE_KEY",
    "PROBE_KEY",
    "SCRATCH_PREFIX",
    "STAGE_LAYERS",
    "STAGE_FINISHED",
    "WORLD_SIZE_HINT",
    "ResumeError",
    "partial_path",
]


PARTIAL_SUFFIX = ".msquant-partial"
PROGRESS_FILE = "progress.json"
PROGRESS_FORMAT = 2  # bumped when the checkpoint layout changes (2: per-process entries)
EXPORT_DIR = "export"
LAYERS_DIR = "layers"
HIDDEN_PREFIX = "hidden-"
OUTSIDE_KEY = "outside"  # quantized modules outside the decoder layers (the output head)
PROBE_KEY = "probe"  # the transform probe's hidden states, in a hidden-state file
#: How :func:`msquant.run.placement.load_for_run` names a streamed run's scratch folder.
SCRATCH_PREFIX = ".msquant-scratch-"
STAGE_LAYERS = "layers"
STAGE_FINISHED = "finished"

# Said after a difference in the number of processes: the one thing a user is likely to change.
WORLD_SIZE_HINT = (
    "a dp_layer_wise run resumes with as many processes as it started with (--nproc, the devices "
    "of --device, torchrun's --nnodes x --nproc_per_node): each takes up its share of the hidden "
    "states"
)


class ResumeError(MsquantInputError):
    """A run cannot be resumed as asked (nothing to resume, other inputs, damaged checkpoint), or
    would silently drop an interrupted run; the message says what differs and what to do."""


def partial_path(save_path: str | Path) -> Path:
    """The checkpoint folder of ``save_path``: ``.{name}.msquant-partial`` beside it."""
    target = Path(save_path).expanduser().absolute()
    return target.parent / f".{target.name}{PARTIAL_SUFFIX}"
