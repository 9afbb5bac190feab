"""How a run holds the model: whole in memory (``model_wise``) or streamed layer by layer.

``layer_wise`` (and ``auto``, as in msModelSlim) stream: the decoder layers stay on disk and the
runner loads one at a time (:mod:`msquant.load.streaming`), so memory does not grow with depth.
``model_wise`` loads every weight up front. Both give the same export, bit for bit.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from msquant.config.spec import RunnerType
from msquant.export.recovery import mark_owned
from msquant.load.integrity import check_finite
from msquant.load.model_folder import load_causal_lm
from msquant.load.streaming import StreamedWeights, load_causal_lm_streaming
from msquant.model.adapter_registry import adapter_for
from msquant.model.checkpoint_names import CheckpointNames
from msquant.model.checkpoint_sources import checkpoint_sources, fused_expert_sources
from msquant.model.layers import DecoderLayer
from msquant.model.moe import MoEInfo
from msquant.run.checkpoint.layout import SCRATCH_PREFIX
from msquant.run.checkpoint.store import LayerStore

__all__ = ["LoadedModel", "load_for_run", "streams"]

logger = logging.getLogger(__name__)


def streams(runner: RunnerType) -> bool:
    """Whether ``runner`` keeps the decoder layers on disk until they run."""
    return runner is not RunnerType.MODEL_WISE


@dataclass
class LoadedModel:
    """The model of a run and, when streamed, where its layers' weights and results go.

    :param checkpoint_names: the names the model's checkpoint uses on disk, when some differ from
        the loaded (unfused) model's (Mixtral's experts); None when all are the same.
    """

    model: nn.Module
    layers: list[DecoderLayer]
    streamed: StreamedWeights | None = None
    spill: LayerStore | None = None
    experts: MoEInfo = MoEInfo()
    checkpoint_names: CheckpointNames | None = None
    #: A streamed run's scratch folder (removed when the run ends); None for a ``model_wise`` run.
    scratch: Path | None = None


@contextmanager
def load_for_run(
    model_dir: Path,
    meta_model: nn.Module,
    *,
    streaming: bool,
    scratch_parent: Path,
    keep_reference: bool,
    trust_remote_code: bool = False,
    scratch_prefix: str | None = None,
) -> Iterator[LoadedModel]:
    """Load the model for a run; a streamed run gets a scratch folder, removed on exit.

    :param meta_model: a weightless instance of the model (its module tree).
    :param scratch_parent: where the scratch folder goes (beside the save path, so that it is on
        the same disk as the export).
    :param keep_reference: keep each released layer's quantized weights (for the read-back check).
    :param scratch_prefix: the scratch folder's name prefix (default ``.msquant-scratch-``); beside
        a save path, ``.NAME.msquant-scratch-``, so that the next run of that save path can tell
        a killed run's folder (:mod:`msquant.export.recovery`).
    """
    adapter = adapter_for(meta_model)  # the architecture's knowledge, by config.model_type
    if not streaming:
        model = load_causal_lm(model_dir, trust_remote_code)
        check_finite(model.state_dict().items())
        experts = adapter.unfuse_experts(model)
        renamed = _renamed(adapter.checkpoint_names(model))
        yield LoadedModel(
            model, adapter.decoder_layers(model), experts=experts, checkpoint_names=renamed
        )
        return
    scratch_parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=scratch_prefix or SCRATCH_PREFIX, dir=scratch_parent))
    mark_owned(scratch, "scratch folder of a streamed run")
    try:
        offload = scratch / "offload"
        offload.mkdir()
        layer_names = [layer.name for layer in adapter.decoder_layers(meta_model)]
        model, streamed = load_causal_lm_streaming(
            model_dir, meta_model, layer_names, offload, trust_remote_code
        )
        check_finite(model.state_dict().items())  # what is loaded now; layers as they stream
        experts = adapter.unfuse_experts(model)  # layers on the meta device: nothing is copied
        names = adapter.checkpoint_names(model)
        if experts:
            # per-expert tensors are read from the checkpoint's own per-expert names; experts the
            # checkpoint holds fused are cut out of the fused tensor transformers loaded
            fused = fused_expert_sources(experts, streamed.sources)
            streamed.sources.update(checkpoint_sources(model, names, model_dir))
            for key, source in fused.items():
                streamed.sources.setdefault(key, source)
        spill = None
        if keep_reference:
            spill = LayerStore(scratch / "reference")
        yield LoadedModel(
            model, adapter.decoder_layers(model), streamed, spill, experts, _renamed(names),
            scratch,
        )  # fmt: skip
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _renamed(names: CheckpointNames) -> CheckpointNames | None:
    """``names`` when the checkpoint names some tensor or module differently from the loaded
    (unfused) model (Mixtral saves ``mlp.experts.3.gate_proj`` as ``block_sparse_moe.experts.3.w1``),
    None when transformers saves every name unchanged.

    Exporters write under these names (:meth:`msquant.plugin.RunContext.disk_name`), so that vLLM,
    vLLM-Ascend, MindIE and transformers load an export the way they load the original checkpoint.
    """
    if names.is_identity:
        return None
    example = next((f"{k} -> {v}" for k, v in names.modules.items() if k != v), "")
    logger.info(
        "the checkpoint names some modules differently from the loaded model (%s); exports use "
        "the checkpoint's names",
        example,
    )
    return names
