"""How a run holds the model: whole in memory (``model_wise``) or streamed layer by layer.

``layer_wise`` (and ``auto``, as in msModelSlim) stream: the decoder layers stay on disk and the
runner loads one at a time (:mod:`msquant.model.streaming`), so memory does not grow with depth.
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
from msquant.context import DecoderLayer
from msquant.errors import ModelLoadError
from msquant.model.layers import find_decoder_layers
from msquant.model.loader import load_causal_lm
from msquant.model.moe import MoEInfo, checkpoint_names, checkpoint_sources, unfuse_experts
from msquant.model.streaming import StreamedWeights, load_causal_lm_streaming
from msquant.resume import LayerStore

__all__ = ["LoadedModel", "load_for_run", "streams"]

logger = logging.getLogger(__name__)


def streams(runner: RunnerType) -> bool:
    """Whether ``runner`` keeps the decoder layers on disk until they run."""
    return runner is not RunnerType.MODEL_WISE


@dataclass
class LoadedModel:
    """The model of a run and, when streamed, where its layers' weights and results go."""

    model: nn.Module
    layers: list[DecoderLayer]
    streamed: StreamedWeights | None = None
    spill: LayerStore | None = None
    experts: MoEInfo = MoEInfo()


@contextmanager
def load_for_run(
    model_dir: Path,
    meta_model: nn.Module,
    *,
    streaming: bool,
    scratch_parent: Path,
    keep_reference: bool,
    trust_remote_code: bool = False,
) -> Iterator[LoadedModel]:
    """Load the model for a run; a streamed run gets a scratch folder, removed on exit.

    :param meta_model: a weightless instance of the model (its module tree).
    :param scratch_parent: where the scratch folder goes (beside the save path, so that it is on
        the same disk as the export).
    :param keep_reference: keep each released layer's quantized weights (for the read-back check).
    """
    if not streaming:
        model = load_causal_lm(model_dir, trust_remote_code)
        experts = unfuse_experts(model)
        _check_expert_names(model, experts)
        yield LoadedModel(model, find_decoder_layers(model), experts=experts)
        return
    scratch_parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".msquant-scratch-", dir=scratch_parent))
    try:
        offload = scratch / "offload"
        offload.mkdir()
        names = [layer.name for layer in find_decoder_layers(meta_model)]
        model, streamed = load_causal_lm_streaming(
            model_dir, meta_model, names, offload, trust_remote_code
        )
        experts = unfuse_experts(model)  # the layers are on the meta device: nothing is copied
        if experts:
            _check_expert_names(model, experts)
            # per-expert tensors are read from the checkpoint's own per-expert names
            streamed.sources.update(checkpoint_sources(model, checkpoint_names(model), model_dir))
        spill = None
        if keep_reference:
            spill = LayerStore(scratch / "reference")
        yield LoadedModel(model, find_decoder_layers(model), streamed, spill, experts)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _check_expert_names(model: nn.Module, experts: MoEInfo) -> None:
    """Exports name tensors by module; refuse MoE models whose checkpoints name them otherwise.

    Qwen2/3-MoE and DeepSeek checkpoints store ``mlp.experts.N.gate_proj`` as the split modules
    are named; Mixtral stores ``block_sparse_moe.experts.N.w1`` and would need the names mapped
    back in every exporter, which is not implemented yet.
    """
    if not experts:
        return
    names = checkpoint_names(model)
    if names.is_identity:
        return
    example = next(
        (f"{n} -> {names.tensor_name(n)}" for n, _ in model.named_parameters()
         if names.tensor_name(n) != n),
        "",
    )  # fmt: skip
    raise ModelLoadError(
        f"{type(model).__name__}: its checkpoint names MoE tensors differently from the modules "
        f"msquant quantizes ({example}); exporting such models (Mixtral-style names) is not "
        "supported yet. Qwen2-MoE, Qwen3-MoE and DeepSeek-style models are."
    )
