"""Reading ``progress.json``, the latest checkpoint of a run, and the names of its per-layer files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from msquant.run.checkpoint.layout import (
    HIDDEN_PREFIX,
    PROGRESS_FILE,
    PROGRESS_FORMAT,
    STAGE_FINISHED,
    ResumeError,
    partial_path,
)

__all__ = ["layer_key", "read_progress", "describe_progress", "hidden_name", "interrupted_work"]


def layer_key(index: int) -> str:
    """The key of layer ``index`` in the layer store and hidden-state files (``00003``)."""
    return f"{index:05d}"


def read_progress(directory: Path) -> dict[str, Any]:
    """The checkpoint in ``directory``.

    :raises ResumeError: when it is unreadable or of another layout version.
    """
    path = directory / PROGRESS_FILE
    fix = "it cannot be resumed: start over with --overwrite (without --resume)"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ResumeError(f"the progress file {path} is unreadable ({error}); {fix}") from error
    if not isinstance(data, dict) or data.get("format") != PROGRESS_FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise ResumeError(
            f"the progress file {path} has layout {found!r}, this msquant writes "
            f"{PROGRESS_FORMAT}; {fix}"
        )
    return data


def describe_progress(directory: Path) -> str:
    """How far the interrupted run in ``directory`` got, for messages (never raises)."""
    try:
        data = json.loads((directory / PROGRESS_FILE).read_text(encoding="utf-8"))
        done, total = data["layers_done"], data["fingerprint"]["num_layers"]
    except (OSError, ValueError, KeyError, TypeError):
        return "progress unreadable"
    if data.get("stage") == STAGE_FINISHED:
        return f"all {total} layers and the export files done"
    return f"{done} of {total} decoder layers done"


def hidden_name(done: int, rank: int) -> str:
    """The file of process ``rank``'s hidden states entering layer ``done``."""
    return f"{HIDDEN_PREFIX}{done:05d}-rank{rank}.safetensors"


def interrupted_work(save_path: str | Path, blocker: str | None = None, known: bool = True) -> str:
    """What became of an interrupted run's work, and how to go on (for the message of a run
    stopped by Ctrl-C, SIGTERM or the loss of a ``dp_layer_wise`` process; never raises).

    :param blocker: why the run wrote no checkpoints (:func:`checkpoint_blocker`), or None when
        it did.
    :param known: False when the caller cannot tell whether the run was checkpointed (the
        launcher of a group): the message then covers both.
    """
    directory = partial_path(save_path)
    if (directory / PROGRESS_FILE).is_file():
        return (
            f"the finished work ({describe_progress(directory)}) is kept in {directory}: run the "
            "same command with --resume to continue after it"
        )
    if not known:
        why = "the run writes no checkpoints, or no decoder layer had finished"
    elif blocker is not None:
        why = f"this run writes no checkpoints: {blocker}"
    else:
        why = "no decoder layer had finished, so there was no checkpoint to keep"
    return f"the work done is lost ({why}); run the same command again to start over"
