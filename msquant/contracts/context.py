"""What processors see during a run: the model, its decoder layers, the device and the output."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn

from msquant.contracts.distributed import SINGLE, Distributed
from msquant.contracts.transforms import TransformLog
from msquant.model.checkpoint_names import CheckpointNames, disk_form
from msquant.model.layers import DecoderLayer
from msquant.model.moe import MoEInfo
from msquant.report.run_report import RunReport

if TYPE_CHECKING:
    from msquant.backends.base import Backend
    from msquant.load.streaming import StreamedWeights
    from msquant.run.checkpoint.store import LayerStore
    from msquant.run.probe import TransformProbe

__all__ = ["DiskNamed", "RunContext", "disk_name"]

V = TypeVar("V")


@dataclass
class RunContext:
    """State shared by the processors of one run.

    :param model: the loaded causal LM (weights on CPU except the layer being processed).
    :param model_path: directory the model was loaded from (savers copy its config/tokenizer files).
    :param output_dir: staging directory savers write into; it is moved to the save path only after
        the whole run succeeded.
    :param backend: the device backend (placement, synchronisation, linear algebra).
    :param layers: the model's decoder layers in execution order.
    :param config_text: the YAML text of the config, when the run came from a file.
    :param progress: whether processors may show progress bars.
    :param extras: free-form per-run values processors may share (keyed by processor type).
    :param report: the run report (``quant_report.json``); processors record each module they
        quantize with ``ctx.report.add_module(...)``, the runner records layer times.
    :param streamed: for a streamed run, where the decoder layers' weights are on disk: the runner
        loads each layer before its processors run and returns it to the meta device after its
        ``after_layer`` (savers must write a layer's tensors there, not in ``finalize``).
    :param spill: for a streamed run, where the runner keeps each released layer's quantized
        weights for the read-back check of the exports.
    :param dist: this process's place in a ``dp_layer_wise`` group (:data:`msquant.plugin.SINGLE` when
        the run has one process): each process sees its share of the calibration batches;
        processors add up what they accumulate with its collectives (``linear_quant`` sums its
        Hessians and shares the solves out); only ``dist.is_main`` runs the savers.
    :param experts: the MoE experts modules split into per-expert linear layers (empty for a
        dense model); ``linear_quant`` rounds experts with too few calibration tokens to nearest.
    :param checkpoint_names: how the model's checkpoint names its tensors and modules on disk,
        when that differs from the loaded model (Mixtral's ``block_sparse_moe.experts.3.w1`` for
        msquant's ``mlp.experts.3.gate_proj``); None when every name is the same. Savers write
        every tensor and every module name of their metadata through :meth:`disk_name`, so that
        engines load the export as they load the original checkpoint.
    :param config_updates: top-level ``config.json`` keys a processor changed in the model (a
        rotation unties the head: ``tie_word_embeddings: false``); savers write them into the
        exported ``config.json`` (:func:`msquant.copy_model_files`).
    :param optional_tensors: tensors a processor asks savers to ship beside the weights, by scope
        (``{"quarot": {"global_rotation": R}}``); the Ascend savers write each scope to
        ``optional/<scope>.safetensors`` and name it in the description's ``optional``.
    :param export_tensors: tensors a processor adds to the export beside the model's own, by full
        tensor name, each with the type a format describes it by (``dynamic_cache``'s
        ``<attention>.k_proj.kv_cache_scale``, ``"C8"``), added at any point before the savers' ``finalize``;
        savers write the pending ones at each ``after_layer`` and in ``finalize`` (a saver refuses a type its
        format does not store, :attr:`msquant.plugin.Saver.tensor_kinds`).
    :param probe: set by the layer runner when a processor transforms weights
        (``transforms_weights``): a few calibration tokens and their hidden states entering the
        current decoder layer, on which such a processor proves that its transform keeps the
        model's function (:mod:`msquant.check`; :class:`msquant.plugin.checks.TransformProbe`); None
        otherwise.
    :param msmodelslim_model_type: the msModelSlim model adapter the run was told to follow
        (``--model_type``, ``quantize(model_type=...)``), None when none was named; processors
        whose msModelSlim counterparts ask the adapter (the smoothing processors: which subgraph
        types they smooth) follow what that adapter answers.
    :param transforms: what processors that transform float weights record of their transforms
        (parameters, fingerprints of the float tensors they set); the run writes it into
        ``msquant_export.json`` and ``msquant verify`` checks the export against it
        (:mod:`msquant.contracts.transforms`).
    """

    model: nn.Module
    model_path: Path
    output_dir: Path
    backend: Backend
    layers: list[DecoderLayer]
    config_text: str | None = None
    progress: bool = True
    extras: dict[str, Any] = field(default_factory=dict)
    report: RunReport = field(default_factory=RunReport)
    streamed: StreamedWeights | None = None
    spill: LayerStore | None = None
    dist: Distributed = SINGLE
    experts: MoEInfo = field(default_factory=MoEInfo)
    checkpoint_names: CheckpointNames | None = None
    config_updates: dict[str, Any] = field(default_factory=dict)
    optional_tensors: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    export_tensors: dict[str, tuple[str, torch.Tensor]] = field(default_factory=dict)
    probe: TransformProbe | None = None
    msmodelslim_model_type: str | None = None
    transforms: TransformLog = field(default_factory=TransformLog)

    def disk_name(self, name: str) -> str:
        """The checkpoint's name for a module or tensor name of the loaded model (see
        :func:`disk_name`); ``name`` itself for a model saved under its own names."""
        return disk_name(self.checkpoint_names, name)

    def disk_form(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``tensors`` with those transformers saves through a conversion (not a rename)
        replaced by their checkpoint form (:func:`msquant.model.checkpoint_names.disk_form`)."""
        if self.checkpoint_names is None:
            return dict(tensors)
        return disk_form(self.model, self.checkpoint_names, tensors)

    def disk_keyed(self, mapping: Mapping[str, V]) -> Mapping[str, V]:
        """``mapping`` (keyed by model module or tensor names) keyed by the checkpoint's names,
        as a view: values are only read when looked up."""
        if self.checkpoint_names is None:
            return mapping
        return DiskNamed(mapping, self.disk_name)

    @property
    def model_type(self) -> str:
        """The Hugging Face ``model_type`` of the model (``"unknown"`` if it has no config)."""
        config = getattr(self.model, "config", None)
        return str(getattr(config, "model_type", "unknown"))


def disk_name(names: CheckpointNames | None, name: str) -> str:
    """The checkpoint's name for ``name``, a module or tensor name of the loaded model.

    A module (``model.layers.0.mlp.experts.3.gate_proj``) gets its disk name
    (``model.layers.0.block_sparse_moe.experts.3.w1``); a tensor of the model or a new tensor of
    one of its modules (``<module>.qweight``) keeps its leaf under the module's disk name. Names
    the checkpoint has no entry for (modules without tensors, e.g. a decoder layer, or tensors
    transformers converts rather than renames) are returned unchanged.
    """
    if names is None:
        return name
    if name in names.modules:
        return names.modules[name]
    try:
        return names.tensor_name(name)
    except LookupError:
        return name


class DiskNamed(Mapping[str, V]):
    """A read-only view of a mapping with every key renamed (model name -> disk name).

    Only the keys are read up front; values are fetched from the underlying mapping on lookup,
    so a mapping that reads its values from disk (a streamed run's layer store) stays lazy.

    :raises ValueError: when two keys get the same new name.
    """

    def __init__(self, mapping: Mapping[str, V], rename: Callable[[str], str]) -> None:
        self._mapping = mapping
        self._keys: dict[str, str] = {}
        for key in mapping:
            new = rename(key)
            if new in self._keys:
                raise ValueError(f"{key} and {self._keys[new]} are both named {new} on disk")
            self._keys[new] = key

    def __getitem__(self, name: str) -> V:
        return self._mapping[self._keys[name]]

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)
