"""Checkpoints of a run, and ``--resume``: a killed run continues after its last finished layer.

A checkpointed run keeps its work in a folder named after the save path,
``.{save_path name}.msquant-partial`` beside it::

    .msquant-owner            says msquant created the folder (one without it is never used)
    export/                   the staging folder: moved to the save path once the run is complete
    layers/00000.safetensors  the quantized linears of each finished decoder layer
    layers/outside.safetensors  quantized linears outside the layers (the head), at the end
    hidden-00004-rank0.safetensors  the hidden states entering the next layer (calibrated runs),
                              one file per process of a ``dp_layer_wise`` group (its share)
    progress.json             the latest checkpoint, replaced atomically after every layer
    .msquant-scratch-*/       a streamed run's scratch folders (offload index), one per process

``progress.json`` holds the run's fingerprint (versions, config and calibration hashes, model
files, device kind, number of processes), how many layers are finished, the run report's
per-layer records and, per process, its hidden-state file and every processor's
:meth:`~msquant.Processor.resume_state` (the savers' writer states, in process 0's entry). It is
written to a temporary file, flushed to the disk and renamed over the previous one, after the
files it names (the layer's quantized linears, every process's new hidden states); so whenever a
process is killed, the folder holds one complete checkpoint.

``quantize(..., resume=True)`` (``msquant quant ... --resume``) checks the fingerprint against
the new run's (a difference is a :class:`ResumeError` naming it), captures the calibration inputs
again (cheap and deterministic: embeddings and masks), rebuilds the finished layers'
:class:`~msquant.QuantizedLinear` modules from ``layers/`` (weightless in a streamed run, as its
released layers are), restores the hidden states, the report and the processors, and runs the
remaining layers. The export is byte-identical to an uninterrupted run's, the report too apart
from its ``*seconds`` fields. A checkpoint of stage ``finished`` (every saver has finalised)
resumes straight at the read-back check, the evaluation and the report.

``dp_layer_wise`` groups (:mod:`msquant.distributed`): process 0 owns the folder. It alone takes
the lock, decides how the run uses the folder (fresh, resumed, refused: every process gets its
decision, or its error), writes the layer store and ``progress.json``; every process writes its
own hidden-state file, and process 0 commits a layer's checkpoint only once all of them are on
disk (their names and sizes are gathered first). A resumed group must have as many processes as
the interrupted one (each takes up its own share of the hidden states); processes other than 0
rebuild no layer (they run no saver and check nothing). Every process must see the folder at the
same path: for several nodes, a save path on a shared file system.

Policy: every run whose processors are all resumable is checkpointed (opt out with
``checkpoints=False``). A run that fails with an exception removes the folder, as a failed run
always removed its staging folder (nothing is left behind, on a full disk least of all); a run
that is stopped after a checkpoint (killed, ``KeyboardInterrupt`` from Ctrl-C, ``SystemExit``, or
in a ``dp_layer_wise`` group the loss of another process: :class:`~msquant.distributed.PeerLostError`)
keeps it for ``--resume``, with a warning saying so. The save path itself is never touched
before the export is complete. A later run of the same save path without ``--resume`` is refused
while such a folder exists, unless ``overwrite`` discards it. The folder is removed once the
export is in place.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from msquant.distributed import SINGLE, Distributed, PeerLostError
from msquant.errors import MsquantInputError, OutputPathError
from msquant.export.marker import sha256_file
from msquant.export.recovery import (
    OWNER_FILE,
    is_owned_dir,
    make_owned_dir,
    mark_owned,
    owned_dir_problem,
)
from msquant.export.shards import WriterStateError, remove_temporaries
from msquant.export.staging import CommitRefusedError
from msquant.model.layers import DecoderLayer
from msquant.plugin.context import RunContext
from msquant.quant.quantized_linear import QuantizedLinear, replace_module
from msquant.quant.quantized_weight import QuantizedWeight
from msquant.version import __version__

if TYPE_CHECKING:
    from msquant.model.capture import CalibrationActivations
    from msquant.plugin.processor import Processor

__all__ = [
    "PARTIAL_SUFFIX",
    "PROGRESS_FILE",
    "LayerStore",
    "ResumeError",
    "RunCheckpoints",
    "agree",
    "checkpoint_blocker",
    "fingerprint_differences",
    "open_checkpoints",
    "partial_path",
    "run_fingerprint",
]

logger = logging.getLogger(__name__)

PARTIAL_SUFFIX = ".msquant-partial"
PROGRESS_FILE = "progress.json"
PROGRESS_FORMAT = 2  # bumped when the checkpoint layout changes (2: per-process entries)
EXPORT_DIR = "export"
LAYERS_DIR = "layers"
HIDDEN_PREFIX = "hidden-"
OUTSIDE_KEY = "outside"  # quantized modules outside the decoder layers (the output head)
#: How :func:`msquant.model.placement.load_for_run` names a streamed run's scratch folder.
SCRATCH_PREFIX = ".msquant-scratch-"
STAGE_LAYERS = "layers"
STAGE_FINISHED = "finished"
_PARTS = ("codes", "scale", "offset")
_FINGERPRINT_LABELS = {
    "msquant_version": "msquant version",
    "torch_version": "torch version",
    "transformers_version": "transformers version",
    "config_sha256": "config (sha256 of the validated spec)",
    "calibration_sha256": "calibration data (sha256 of the token ids)",
    "model_path": "model path",
    "model_files": "model files",
    "device_kind": "device kind",
    "num_layers": "number of decoder layers",
    "world_size": "number of processes (dp_layer_wise)",
}
# Said after a difference in the number of processes: the one thing a user is likely to change.
_WORLD_SIZE_HINT = (
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


# -- fingerprint --------------------------------------------------------------------------------


def _model_files(model_dir: Path) -> dict[str, list[int]]:
    """Size and modification time (ns) of the files defining the model: config, weights, code.

    Sizes and times, not hashes: hashing hundreds of GB of weights would cost minutes per run.
    """
    files = {}
    for path in sorted(model_dir.iterdir()):
        name = path.name
        relevant = name == "config.json" or name.endswith((".safetensors", ".index.json", ".py"))
        if relevant and path.is_file():
            stat = path.stat()
            files[name] = [stat.st_size, stat.st_mtime_ns]
    return files


def _package_version(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "unknown"


def run_fingerprint(
    *,
    config_sha256: str,
    calibration_sha256: str | None,
    model_dir: Path,
    device_kind: str,
    num_layers: int,
) -> dict[str, Any]:
    """What must not change between a run and its resumption (anything that changes a result)."""
    return {
        "msquant_version": __version__,
        "torch_version": torch.__version__,
        "transformers_version": _package_version("transformers"),
        "config_sha256": config_sha256,
        "calibration_sha256": calibration_sha256,
        "model_path": str(Path(model_dir).expanduser().absolute()),
        "model_files": _model_files(Path(model_dir)),
        "device_kind": device_kind,
        "num_layers": num_layers,
    }


def _short(value: Any) -> str:
    return f"{value[:12]}..." if isinstance(value, str) and len(value) > 16 else str(value)


# Shown whole in messages: two paths cut to 12 characters often look identical.
_SHOWN_WHOLE = frozenset({"model_path"})


def _files_difference(then: Mapping[str, Any], now: Mapping[str, Any]) -> str:
    parts = [f"{name} removed" for name in sorted(set(then) - set(now))]
    parts += [f"{name} added" for name in sorted(set(now) - set(then))]
    parts += [
        f"{name} changed (size or modification time)"
        for name in sorted(set(then) & set(now))
        if list(then[name]) != list(now[name])
    ]
    return ", ".join(parts)


def fingerprint_differences(recorded: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """One line per input that differs between a checkpoint and the run resuming it."""
    lines = []
    for key, label in _FINGERPRINT_LABELS.items():
        then, now = recorded.get(key), current.get(key)
        if then == now:
            continue
        if key == "model_files":
            lines.append(f"{label}: {_files_difference(then or {}, now or {})}")
        elif key == "world_size":
            lines.append(f"{label}: {then} then, {now} now; {_WORLD_SIZE_HINT}")
        elif key in _SHOWN_WHOLE:
            lines.append(f"{label}: {then} then, {now} now")
        else:
            lines.append(f"{label}: {_short(then)} then, {_short(now)} now")
    return lines


def checkpoint_blocker(processors: Sequence[Processor], enabled: bool = True) -> str | None:
    """Why this run cannot be checkpointed, or None when it can (the same in every process of a
    ``dp_layer_wise`` group: pass all the run's processors, savers included)."""
    if not enabled:
        return "checkpoints are turned off (--no_checkpoints; Python: checkpoints=False)"
    for processor in processors:
        if not processor.resumable:
            return (
                f"processor {processor.type_name} cannot be resumed (it does not set "
                "Processor.resumable)"
            )
    return None


# -- files ----------------------------------------------------------------------------------------


def _fsync_directory(directory: Path) -> None:
    """Make a rename in ``directory`` durable (best effort: not every platform can)."""
    try:
        handle = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(handle)
    except OSError:
        pass
    finally:
        os.close(handle)


def _replace_durably(tmp: Path, path: Path) -> None:
    """Flush ``tmp`` to the disk and rename it to ``path`` (atomic on one file system)."""
    with open(tmp, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    _fsync_directory(path.parent)


def _write_json_atomically(path: Path, data: Mapping[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data) + "\n", encoding="utf-8")
    _replace_durably(tmp, path)


def _save_tensors_atomically(
    tensors: Mapping[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None
) -> None:
    tmp = path.with_name(path.name + ".tmp")
    save_file(dict(tensors), str(tmp), metadata=metadata)
    _replace_durably(tmp, path)


# -- the quantized linears of finished layers ----------------------------------------------------


class LayerStore(Mapping[str, QuantizedWeight]):
    """The quantized linears of finished layers, one safetensors file per layer, kept across runs.

    A read-only mapping ``module name ->`` :class:`~msquant.QuantizedWeight`, read from disk on
    demand: in a streamed run it is the reference of the read-back check for the layers released
    from memory (the checkpoints' store, or without checkpoints a scratch one: ``ctx.spill``).

    :param directory: where the files go (created on first use).
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._modules: dict[str, tuple[Path, dict[str, Any]]] = {}

    def path(self, key: str) -> Path:
        """The file of ``key`` (a layer index as ``00003``, or ``outside``)."""
        return self.directory / f"{key}.safetensors"

    def save(
        self, key: str, root: nn.Module, prefix: str, exclude: Sequence[str] = ()
    ) -> list[str]:
        """Write every :class:`QuantizedLinear` with data under ``root`` (full names under
        ``prefix``; those under an ``exclude`` prefix skipped) as ``key``'s file.

        :returns: the names written.
        """
        tensors: dict[str, torch.Tensor] = {}
        entries: dict[str, dict[str, Any]] = {}
        for name, module in root.named_modules(prefix=prefix):
            if not isinstance(module, QuantizedLinear) or module.weight.is_meta:
                continue
            if any(name == p or name.startswith(p + ".") for p in exclude):
                continue
            qweight = module.qweight
            for part in _PARTS:
                tensors[f"{name}.{part}"] = getattr(qweight, part).detach().to("cpu").contiguous()
            bias = module.bias
            if bias is not None:
                tensors[f"{name}.bias"] = bias.detach().to("cpu").contiguous()
            entries[name] = {
                "bits": qweight.bits,
                "symmetric": qweight.symmetric,
                "group_size": qweight.group_size,
                "method": module.method,
                "act_order": module.act_order,
                "shape": list(qweight.shape),
                "bias": None if bias is None else str(bias.dtype).removeprefix("torch."),
            }
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.path(key)
        _save_tensors_atomically(tensors, path, {"modules": json.dumps(entries)})
        self._modules.update({name: (path, entry) for name, entry in entries.items()})
        return list(entries)

    def load(self, key: str) -> dict[str, dict[str, Any]]:
        """Index ``key``'s file (written by an earlier run); returns its modules' entries.

        :raises ResumeError: when the file is missing or unreadable.
        """
        path = self.path(key)
        try:
            with safe_open(str(path), framework="pt") as handle:
                metadata = handle.metadata() or {}
            entries: dict[str, dict[str, Any]] = json.loads(metadata["modules"])
        except (OSError, SafetensorError, KeyError, json.JSONDecodeError) as error:
            raise ResumeError(
                f"the checkpoint file {path} is missing or damaged ({error}); the interrupted run "
                "cannot be resumed: start over with --overwrite (without --resume)"
            ) from error
        self._modules.update({name: (path, entry) for name, entry in entries.items()})
        return entries

    def rebuild(self, model: nn.Module, key: str, weightless: bool) -> None:
        """Put ``key``'s quantized linears back into ``model`` in place of its float ones.

        :param weightless: build them on the meta device (a streamed run's released layers),
            without reading their tensors.
        """
        for name, entry in self.load(key).items():
            try:
                current = model.get_submodule(name)
            except AttributeError:
                raise ResumeError(
                    f"{name}: the checkpoint holds a quantized linear the model does not have: "
                    "the model changed since the run started"
                ) from None
            shape = tuple(entry["shape"])
            found = tuple(getattr(current, "weight", torch.empty(0)).shape)
            if not isinstance(current, nn.Linear | QuantizedLinear) or found != shape:
                raise ResumeError(
                    f"{name}: the checkpoint holds a quantized linear {shape}, the model has "
                    f"{type(current).__name__} {found}: the model changed since the run started"
                )
            qweight, bias = (
                self._weightless(entry) if weightless else (self[name], self._bias(name))
            )
            replace_module(
                model,
                name,
                QuantizedLinear(qweight, bias, entry["method"], entry.get("act_order", False)),
            )

    @staticmethod
    def _weightless(entry: Mapping[str, Any]) -> tuple[QuantizedWeight, torch.Tensor | None]:
        out_features, in_features = entry["shape"]
        group_size = entry["group_size"]
        groups = 1 if group_size is None else in_features // group_size
        meta = torch.device("meta")
        qweight = QuantizedWeight(
            torch.empty(out_features, in_features, dtype=torch.int8, device=meta),
            torch.empty(out_features, groups, dtype=torch.float32, device=meta),
            torch.empty(out_features, groups, dtype=torch.float32, device=meta),
            entry["bits"],
            entry["symmetric"],
            group_size,
        )
        dtype = entry["bias"]
        if dtype is None:
            return qweight, None
        return qweight, torch.empty(out_features, dtype=getattr(torch, dtype), device=meta)

    def _bias(self, name: str) -> torch.Tensor | None:
        path, entry = self._modules[name]
        if entry["bias"] is None:
            return None
        with safe_open(str(path), framework="pt") as handle:
            return handle.get_tensor(f"{name}.bias")

    def __getitem__(self, name: str) -> QuantizedWeight:
        path, entry = self._modules[name]
        with safe_open(str(path), framework="pt") as handle:
            codes, scale, offset = (handle.get_tensor(f"{name}.{part}") for part in _PARTS)
        return QuantizedWeight(
            codes, scale, offset, entry["bits"], entry["symmetric"], entry["group_size"]
        )

    def __iter__(self) -> Iterator[str]:
        return iter(self._modules)

    def __len__(self) -> int:
        return len(self._modules)


# -- checkpoints ---------------------------------------------------------------------------------


def _layer_key(index: int) -> str:
    return f"{index:05d}"


def _read_progress(directory: Path) -> dict[str, Any]:
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


def _describe(directory: Path) -> str:
    """How far the interrupted run in ``directory`` got, for messages (never raises)."""
    try:
        data = json.loads((directory / PROGRESS_FILE).read_text(encoding="utf-8"))
        done, total = data["layers_done"], data["fingerprint"]["num_layers"]
    except (OSError, ValueError, KeyError, TypeError):
        return "progress unreadable"
    if data.get("stage") == STAGE_FINISHED:
        return f"all {total} layers and the export files done"
    return f"{done} of {total} decoder layers done"


def _discard(directory: Path) -> None:
    """Remove an interrupted run's folder (its owner checked already; the caller holds the save
    path's lock, so no run uses it; process 0 of a ``dp_layer_wise`` group alone gets here)."""
    shutil.rmtree(directory, ignore_errors=True)


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


def open_checkpoints(
    save_path: str | Path,
    fingerprint: Mapping[str, Any],
    *,
    resume: bool,
    overwrite: bool,
    blocker: str | None,
    dist: Distributed = SINGLE,
) -> RunCheckpoints | None:
    """Decide, before any work, how this run uses the checkpoint folder of ``save_path``.

    In a ``dp_layer_wise`` group process 0 decides (it alone reads and changes the folder) and
    every process gets its decision or its error; every process must call this.

    :param fingerprint: the run's :func:`run_fingerprint` (the number of processes is added here).
    :param blocker: why this run cannot be checkpointed (:func:`checkpoint_blocker`), or None.
    :returns: the run's checkpoints (resuming or fresh), or None when it is not checkpointed.
    :raises ResumeError: ``resume`` with nothing to resume, another run's inputs (another number
        of processes included), an unreadable checkpoint or a run that cannot be checkpointed; or
        an interrupted run left for this save path while neither ``resume`` nor ``overwrite``
        says what to do with it.
    """
    fingerprint = {**fingerprint, "world_size": dist.world_size}
    directory = partial_path(save_path)
    decision: tuple[bool, dict[str, Any] | None] | None = None
    error: Exception | None = None
    if dist.is_main:
        try:
            decision = _decide(save_path, directory, fingerprint, resume, overwrite, blocker)
        except Exception as caught:  # every process must learn of it
            error = caught
    agree(dist, error)
    decision = dist.broadcast_object(decision, 0)
    assert decision is not None
    checkpointed, progress = decision
    if not checkpointed:
        return None
    return RunCheckpoints(directory, fingerprint, progress, dist)


def _decide(
    save_path: str | Path,
    directory: Path,
    fingerprint: Mapping[str, Any],
    resume: bool,
    overwrite: bool,
    blocker: str | None,
) -> tuple[bool, dict[str, Any] | None]:
    """What :func:`open_checkpoints` does with the folder: (checkpointed, checkpoint to resume)."""
    problem = owned_dir_problem(directory, "msquant's checkpoint folder of this save path")
    if problem is not None:
        raise OutputPathError(problem)
    interrupted = (directory / PROGRESS_FILE).is_file()
    if resume and blocker is not None:
        raise ResumeError(f"--resume: this run is not checkpointed: {blocker}")
    if resume:
        return True, _resume_progress(save_path, directory, fingerprint, interrupted)
    if interrupted and not overwrite:
        raise ResumeError(
            f"an interrupted run of {Path(save_path)} is kept in {directory} ({_describe(directory)}): "
            "add --resume (Python: resume=True) to continue it, or --overwrite to start over "
            "and discard it"
        )
    if interrupted:
        logger.warning(
            "--overwrite: discarding the interrupted run in %s (%s)",
            directory,
            _describe(directory),
        )
    if blocker is not None:
        if directory.exists():
            _discard(directory)
        logger.info("no checkpoints: %s", blocker)
        return False, None
    return True, None


def _resume_progress(
    save_path: str | Path, directory: Path, fingerprint: Mapping[str, Any], interrupted: bool
) -> dict[str, Any] | None:
    """The checkpoint ``--resume`` continues from (None: start from the first layer)."""
    if not directory.is_dir():
        raise ResumeError(
            f"--resume: there is no interrupted run of {Path(save_path)} to resume (no {directory}); "
            "run without --resume"
        )
    if not interrupted:
        logger.warning(
            "--resume: the interrupted run in %s had not finished a layer; starting from the first",
            directory,
        )
        return None
    progress = _read_progress(directory)
    differences = fingerprint_differences(progress.get("fingerprint", {}), fingerprint)
    if differences:
        raise ResumeError(
            f"--resume: the interrupted run in {directory} was started with other inputs, so its "
            "layers cannot be reused:\n"
            + "\n".join(f"  - {line}" for line in differences)
            + "\nrerun with the same inputs and --resume, or drop --resume and pass --overwrite "
            "to start over"
        )
    return progress


def _hidden_name(done: int, rank: int) -> str:
    """The file of process ``rank``'s hidden states entering layer ``done``."""
    return f"{HIDDEN_PREFIX}{done:05d}-rank{rank}.safetensors"


class RunCheckpoints:
    """The checkpoint folder of one run: what the runner calls after each layer and on resume.

    :param directory: the folder (:func:`partial_path`).
    :param fingerprint: the run's :func:`run_fingerprint`.
    :param progress: the checkpoint to resume from, or None for a fresh run (the folder is then
        emptied when the run starts).
    :param dist: this process's place in a ``dp_layer_wise`` group (process 0 owns the folder;
        every process writes its own hidden states).
    """

    def __init__(
        self,
        directory: Path,
        fingerprint: Mapping[str, Any],
        progress: Mapping[str, Any] | None,
        dist: Distributed = SINGLE,
    ) -> None:
        self.directory = directory
        self.fingerprint = dict(fingerprint)
        self.progress = progress
        self.dist = dist
        self.store = LayerStore(directory / LAYERS_DIR)

    @property
    def export_dir(self) -> Path:
        """The staging folder of the export (moved to the save path at the end)."""
        return self.directory / EXPORT_DIR

    @property
    def resuming(self) -> bool:
        """Whether this run continues from a checkpoint."""
        return self.progress is not None

    @property
    def finished(self) -> bool:
        """Whether the checkpoint resumed from was taken after every saver finalised."""
        return self.progress is not None and self.progress.get("stage") == STAGE_FINISHED

    @contextmanager
    def guard(self) -> Iterator[None]:
        """Hold the folder for the whole run (enter it before the model is loaded: a streamed
        run's scratch folder goes in it): created, emptied for a fresh run, rid of the scratch
        folders of killed runs when resuming; removed after success or an error, kept (with a
        hint) when the run is interrupted after a checkpoint, when the checkpoint cannot be taken
        up (:class:`ResumeError`: nothing is changed, ``--overwrite`` discards it) and when the
        finished export could not be moved into place
        (:class:`~msquant.export.staging.CommitRefusedError`: ``--resume`` moves it later).

        The caller holds the save path's lock (:class:`~msquant.export.recovery.SavePathLock`).
        In a ``dp_layer_wise`` group process 0 does all of that; the others wait until the folder
        is ready (every process must enter), and leave it alone afterwards. Losing another
        process (:class:`~msquant.distributed.PeerLostError`) counts as an interruption."""
        main = self.dist.is_main
        error: Exception | None = None
        if main:
            try:
                self._prepare()
            except Exception as caught:  # the others wait for the folder: tell them
                error = caught
        agree(self.dist, error)
        try:
            yield
        except PeerLostError:
            if main:
                self._keep_or_remove()  # another process was killed: as if this one were
            raise
        except (ResumeError, CommitRefusedError):
            raise  # the folder is kept, as the message says
        except Exception:
            if main:
                self._remove()  # a failed run leaves nothing behind, checkpointed or not
            raise
        except BaseException:
            if main:
                self._keep_or_remove()
            raise
        else:
            if main:
                self._remove()

    def _prepare(self) -> None:
        """Create the folder (marked as msquant's); empty it for a fresh run, or drop the scratch
        folders a killed run left (of every process) when resuming."""
        problem = owned_dir_problem(self.directory, "msquant's checkpoint folder of this save path")
        if problem is not None:
            raise OutputPathError(problem)
        if not os.path.lexists(self.directory):
            make_owned_dir(self.directory, "checkpoints of a run (msquant --resume)")
        elif not is_owned_dir(self.directory):  # empty: a kill came before it was marked
            mark_owned(self.directory, "checkpoints of a run (msquant --resume)")
        elif self.progress is None:
            self._empty()
        else:
            for stale in self.directory.glob(f"{SCRATCH_PREFIX}*"):
                shutil.rmtree(stale, ignore_errors=True)

    def _keep_or_remove(self) -> None:
        """After an interruption (Ctrl-C, ``SystemExit``, a lost process), keep what has been
        checkpointed, saying how to continue."""
        if not (self.directory / PROGRESS_FILE).is_file():
            self._remove()
            return
        logger.warning(
            "interrupted: the finished work (%s) is kept in %s; run the same command with "
            "--resume to continue, or with --overwrite to start over",
            _describe(self.directory),
            self.directory,
        )

    def _empty(self) -> None:
        """Remove everything but the owner file (the folder is msquant's: checked first)."""
        for child in self.directory.iterdir():
            if child.name == OWNER_FILE:
                continue
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()

    def _remove(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)

    # -- after each layer ---------------------------------------------------------------------

    def keep_layer(self, layer: DecoderLayer) -> None:
        """Store the finished layer's quantized linears (before a streamed run releases it;
        process 0 alone: every process holds the same results)."""
        if self.dist.is_main:
            self.store.save(_layer_key(layer.index), layer.module, layer.name)

    def commit_layer(
        self,
        ctx: RunContext,
        processors: Sequence[Processor],
        layer: DecoderLayer,
        activations: CalibrationActivations | None,
    ) -> None:
        """Write the checkpoint after ``layer``: every process's hidden states, then (process 0,
        once all are on disk) the progress file; then each process drops its older ones."""
        done = layer.index + 1
        hidden = None if activations is None else self._save_hidden(done, activations.hidden)
        states = [{"type": p.type_name, "state": p.resume_state(ctx)} for p in processors]
        ranks = self.dist.all_gather_object({"hidden": hidden, "processors": states})
        if self.dist.is_main:
            self._write_progress(ctx, stage=STAGE_LAYERS, layers_done=done, ranks=ranks)
        self.dist.barrier()  # committed: the files of the previous checkpoint are not needed
        self._remove_hidden(keep=None if hidden is None else hidden["file"])
        logger.debug("checkpoint: %d of %d layers", done, len(ctx.layers))

    def commit_finished(self, ctx: RunContext) -> None:
        """The last checkpoint, once every saver has finalised: a resumed run then only checks,
        evaluates and reports. The hidden files the writers kept for earlier checkpoints go.

        Every process calls it: the others write nothing in the folder after it (process 0 may
        remove the folder once it is done)."""
        if self.dist.is_main:
            layers = [layer.name for layer in ctx.layers]
            self.store.save(OUTSIDE_KEY, ctx.model, "", exclude=layers)
            self._write_progress(ctx, stage=STAGE_FINISHED, layers_done=len(ctx.layers), ranks=[])
        self.dist.barrier()
        self._remove_hidden(keep=None)
        if self.dist.is_main:
            removed = remove_temporaries(self.export_dir)
            logger.debug("checkpoint: finished (%d temporary file(s) removed)", removed)

    def _write_progress(
        self, ctx: RunContext, *, stage: str, layers_done: int, ranks: list[dict[str, Any]]
    ) -> None:
        """``progress.json``: ``ranks`` holds each process's hidden-state file and processor
        states, by rank."""
        progress = {
            "format": PROGRESS_FORMAT,
            "stage": stage,
            "fingerprint": self.fingerprint,
            "layers_done": layers_done,
            "report": ctx.report.layer_records(),
            "ranks": ranks,
        }
        _write_json_atomically(self.directory / PROGRESS_FILE, progress)

    def _save_hidden(self, done: int, hidden: Sequence[torch.Tensor]) -> dict[str, Any]:
        name = _hidden_name(done, self.dist.rank)
        tensors = {_layer_key(i): h.detach().to("cpu").contiguous() for i, h in enumerate(hidden)}
        path = self.directory / name
        _save_tensors_atomically(tensors, path)
        return {
            "file": name,
            "batches": len(tensors),
            "bytes": path.stat().st_size,
            "sha256": sha256_file(path),
        }

    def _remove_hidden(self, keep: str | None) -> None:
        """Remove this process's hidden-state files (and temporaries) but ``keep``."""
        for path in self.directory.glob(f"{HIDDEN_PREFIX}*-rank{self.dist.rank}.safetensors*"):
            if path.name != keep:
                path.unlink(missing_ok=True)

    # -- resuming ----------------------------------------------------------------------------

    def restore(
        self,
        ctx: RunContext,
        processors: Sequence[Processor],
        activations: CalibrationActivations | None,
    ) -> int:
        """Take up the checkpoint (after ``setup`` and the capture): rebuild the finished layers,
        restore the hidden states, the report and the processors (in a ``dp_layer_wise`` group,
        each process its own; every process must call this).

        :returns: the index of the first layer still to run.
        :raises ResumeError: when the checkpoint does not fit this run or its files are damaged
            (in every process, when any process finds that).
        """
        done = 0
        error: ResumeError | None = None
        try:
            done = self._restore(ctx, processors, activations)
        except ResumeError as caught:
            error = caught
        agree(self.dist, error)
        logger.info(
            "resuming after layer %d of %d (checkpoint in %s)",
            done,
            len(ctx.layers),
            self.directory,
        )
        return done

    def _restore(
        self,
        ctx: RunContext,
        processors: Sequence[Processor],
        activations: CalibrationActivations | None,
    ) -> int:
        progress = self.progress
        assert progress is not None and not self.finished
        ranks = progress["ranks"]
        if len(ranks) != self.dist.world_size:  # the fingerprint says so first
            raise ResumeError(
                f"--resume: the checkpoint was taken by {len(ranks)} process(es), this run has "
                f"{self.dist.world_size}; {_WORLD_SIZE_HINT}"
            )
        mine = ranks[self.dist.rank]
        recorded = [entry["type"] for entry in mine["processors"]]
        if recorded != [p.type_name for p in processors]:
            raise ResumeError(
                f"--resume: the checkpoint's processors {recorded} are not this run's "
                f"{[p.type_name for p in processors]}"
            )
        done = int(progress["layers_done"])
        self._rebuild(ctx, done)
        if activations is not None:
            self._load_hidden(activations, mine["hidden"], done)
        ctx.report.restore_layer_records(progress["report"])
        for processor, entry in zip(processors, mine["processors"], strict=True):
            try:
                processor.restore(ctx, entry["state"])
            except (WriterStateError, OSError, KeyError, TypeError, ValueError) as error:
                raise ResumeError(
                    f"--resume: {processor.type_name} cannot take up its checkpoint ({error}); "
                    "start over with --overwrite (without --resume)"
                ) from error
        return done

    def restore_finished(self, ctx: RunContext) -> None:
        """Take up a ``finished`` checkpoint: the quantized modules and the report (the export
        files are complete in :attr:`export_dir`). Process 0 alone has anything to take up; the
        others only learn whether it could."""
        assert self.progress is not None and self.finished
        error: ResumeError | None = None
        if self.dist.is_main:
            try:
                self._restore_finished(ctx, self.progress)
            except ResumeError as caught:
                error = caught
        agree(self.dist, error)
        logger.info(
            "resuming after the export files were written (checkpoint in %s)", self.directory
        )

    def _restore_finished(self, ctx: RunContext, progress: Mapping[str, Any]) -> None:
        if not self.export_dir.is_dir() or not any(self.export_dir.iterdir()):
            raise ResumeError(
                f"--resume: the export files of the checkpoint in {self.directory} are missing; "
                "start over with --overwrite (without --resume)"
            )
        removed = remove_temporaries(
            self.export_dir
        )  # a kill may have come before commit_finished did
        if removed:
            logger.debug("checkpoint: %d temporary file(s) of the writers removed", removed)
        self._rebuild(ctx, len(ctx.layers))
        self.store.rebuild(ctx.model, OUTSIDE_KEY, weightless=False)
        ctx.report.restore_layer_records(progress["report"])

    def _rebuild(self, ctx: RunContext, count: int) -> None:
        """The first ``count`` layers as a run leaves them: quantized linears in place (process 0
        only: the others run no saver and check nothing), and in a streamed run every tensor
        released to the meta device."""
        streamed = ctx.streamed
        for layer in ctx.layers[:count]:
            if self.dist.is_main:
                key = _layer_key(layer.index)
                self.store.rebuild(ctx.model, key, weightless=streamed is not None)
            loaded = any(not t.is_meta for t in layer.module.state_dict().values())
            if streamed is not None and loaded:  # capture loads the first layer
                streamed.release(layer.module)

    def _load_hidden(
        self, activations: CalibrationActivations, info: Mapping[str, Any] | None, done: int
    ) -> None:
        """The hidden states entering layer ``done`` (this process's share, recorded as
        ``info``), in place of the captured ones."""
        path = None if info is None else self.directory / info["file"]
        whose = f" of process {self.dist.rank}" if self.dist.active else ""
        if (
            info is None
            or path is None
            or not path.is_file()
            or path.stat().st_size != info["bytes"]
            or sha256_file(path) != info.get("sha256")
        ):
            raise ResumeError(
                f"--resume: the hidden states{whose} of the checkpoint in {self.directory} are "
                "missing or damaged; start over with --overwrite (without --resume)"
            )
        with safe_open(str(path), framework="pt") as handle:
            hidden = [handle.get_tensor(_layer_key(i)) for i in range(int(info["batches"]))]
        captured = activations.hidden
        shapes = [(tuple(h.shape), h.dtype) for h in hidden]
        if shapes != [(tuple(h.shape), h.dtype) for h in captured]:
            raise ResumeError(
                f"--resume: the checkpoint's hidden states{whose} {shapes} do not match the "
                "calibration batches of this run"
            )
        activations.hidden = [h.to(c.device) for h, c in zip(hidden, captured, strict=True)]
        activations.next_layer = done
