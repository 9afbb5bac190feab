"""``fa3_quant``: int8 / float8 quantization of the attention's query / key / value (msModelSlim's FA3).

Sample yaml (msModelSlim's DeepSeek-V3 ``w4a8c8`` practices)::

    spec:
      process:
        - type: fa3_quant          # default qconfig: int8 per_head symmetric minmax (static)
          exclude: ["model.layers.0.*"]
      save:
        - type: ascendv1_saver

For each selected attention module (:mod:`msquant.processors.fa3.attention` lists the classes
msquant can prove it handles; any other is refused, naming it), a static (``per_head``) branch
observes its tensor on every calibration sample (one sample at a time, as msModelSlim), keeps
the recall-window range per head (:mod:`msquant.processors.fa3.numerics`) and, after the layer,
turns it into a float32 scale per head; a dynamic (``per_token``) branch needs no data and only
tells the consumer to quantize per token. Nothing in the model changes: the scales are written by
the Ascend savers (``<attention>.fa_q.scale`` / ``.offset``, typed ``FAQuant``, and the
``quant_type`` / ``fa_quant_type`` description keys, :mod:`msquant.processors.formats.ascend.fa_quant`),
so a run without one is refused.

Observation point: msModelSlim runs each ``spec.process`` entry with its own forward, after the
entries before it finished the layer, so an ``fa3_quant`` entry after ``linear_quant`` observes
the attention through the already fake-quantized linears, and the next layer gets that forward's
outputs. A static branch sets ``calibrates_after_previous`` so that msquant does the same: the
entries before it run their passes and ``after_layer`` first (the linears quantized), then this
processor's passes observe the processed layer, and the next layer's inputs are their outputs
(``tests/oracle/test_msmodelslim_fa3.py`` compares both orders with msModelSlim).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from msquant.plugin import (
    ConfigIssue,
    DecoderLayer,
    Processor,
    ProcessorConfig,
    QDType,
    QScope,
    QuantizationError,
    RunContext,
)
from msquant.plugin.model import is_selected
from msquant.processors.fa3.attention import MLA, find_attention, observe_mla
from msquant.processors.fa3.config import FA3QConfig, FA3QuantConfig, config_issues
from msquant.processors.fa3.numerics import (
    head_samples,
    merge_range,
    per_head_fp8_scale,
    per_head_int8_scale,
    recall_window,
)
from msquant.processors.formats.ascend.fa_quant import (
    EXTRAS_KEY,
    FAQuantRecord,
    branch_letter,
    point_quant_type,
    quant_type_name,
    static_tensors,
)

__all__ = ["FA3QuantProcessor"]

logger = logging.getLogger(__name__)

Range = tuple[torch.Tensor, torch.Tensor]
#: A static branch's scale from its observed range, by qconfig dtype (config.IMPLEMENTED_DTYPES).
PER_HEAD_SCALES: dict[QDType, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    QDType.INT8: per_head_int8_scale,
    QDType.FP8_E4M3: per_head_fp8_scale,
}


class FA3QuantProcessor(Processor):
    """Attention activation quantization (see the module docstring)."""

    type_name = "fa3_quant"
    config_class = FA3QuantConfig
    config: FA3QuantConfig

    def __init__(self, config: ProcessorConfig) -> None:
        super().__init__(config)
        self.branches: dict[str, FA3QConfig] = self.config.branch_configs()
        static = any(c.scope == QScope.PER_HEAD for c in self.branches.values())
        self.requires_calibration = static
        # observe the layer as the entries before this one in spec.process left it (msModelSlim)
        self.calibrates_after_previous = static
        # msModelSlim observes one sample at a time (its per-head rows assume a batch of one)
        self.batch_calibration = not static
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._ranges: dict[tuple[str, str], Range | None] = {}
        self._record = FAQuantRecord()

    @classmethod
    def check_config(cls, config: ProcessorConfig) -> list[ConfigIssue]:
        assert isinstance(config, FA3QuantConfig)
        return config_issues(config)

    # --- selection -----------------------------------------------------------------------

    def _points(self, layer: DecoderLayer) -> list[tuple[str, nn.Module, list[str]]]:
        """The selected attention points of ``layer``: (name, module, its branches)."""
        points = []
        for name, module, kind in find_attention(layer.module, layer.name):
            if not is_selected(name, self.config.include, self.config.exclude):
                continue
            if kind is None:
                raise QuantizationError(self._unknown(name, module))
            names = [b for b, _ in kind.branches if self._config_of(b) is not None]
            points.append((name, module, names))
        return points

    def _config_of(self, branch: str) -> FA3QConfig | None:
        """The scheme of a branch: ``fa_q`` ... by name; GLM-5's ``fa3_q`` / ``fa3_k`` take
        ``qconfig`` (``details`` is refused for them in :meth:`check_model`)."""
        if branch in self.branches:
            return self.branches[branch]
        return None if self.config.details is not None else self.branches["fa_q"]

    def _is_static(self, branch: str) -> bool:
        qconfig = self._config_of(branch)
        return qconfig is not None and qconfig.scope == QScope.PER_HEAD

    @staticmethod
    def _unknown(name: str, module: nn.Module) -> str:
        cls = type(module)
        return (
            f"fa3_quant: {name} is a {cls.__module__}.{cls.__name__}, an attention msquant has no "
            "FA3 adapter for (known: transformers' DeepseekV3Attention, msModelSlim's deepseek_v3 "
            "adapter, and GlmMoeDsaIndexer, its glm_5 adapter; msquant.processors.fa3.attention): "
            "it cannot tell where this attention's query, key and value are; exclude the module "
            "(exclude: ['" + name + "']) or remove fa3_quant"
        )

    def check_model(self, model: nn.Module, layers: list[DecoderLayer]) -> list[str]:
        problems: list[str] = []
        selected = 0
        for layer in layers:
            for name, module, kind in find_attention(layer.module, layer.name):
                if not is_selected(name, self.config.include, self.config.exclude):
                    continue
                selected += 1
                if kind is None:
                    problems.append(self._unknown(name, module))
                    continue
                if kind is not MLA and self.config.details is not None:
                    problems.append(
                        f"fa3_quant: {name} ({kind.class_name}) has the points "
                        f"{', '.join(b for b, _ in kind.branches)}, which details (fa_q, fa_k, "
                        "fa_v) does not name: msModelSlim 26.1.0 then quantizes nothing there; "
                        "use qconfig"
                    )
                    continue
                static = [b for b, _ in kind.branches if self._is_static(b)]
                if static and not kind.observable:
                    problems.append(
                        f"fa3_quant: {name} ({kind.class_name}): per_head (static) is not "
                        f"implemented for {', '.join(static)} (msquant does not observe this "
                        "attention's points yet); use scope: per_token"
                    )
        if not selected and not problems:
            logger.warning(
                "fa3_quant selects no attention module (include %s, exclude %s): it does nothing",
                self.config.include,
                self.config.exclude,
            )
        return problems

    # --- the run -------------------------------------------------------------------------

    def setup(self, ctx: RunContext) -> None:
        self._record = ctx.extras.setdefault(EXTRAS_KEY, FAQuantRecord())

    def before_layer(self, ctx: RunContext, layer: DecoderLayer) -> None:
        if not self._record.writers:
            raise QuantizationError(
                "fa3_quant: no saver of this run writes FA3 scales (ascendv1_saver and "
                "mindie_format_saver do): add one to spec.save"
            )
        self._ranges = {}
        for name, module, branches in self._points(layer):
            static = [b for b in branches if self._is_static(b)]
            for branch in static:
                self._ranges[(name, branch)] = None
            if static:
                self._hooks += observe_mla(module, self._observer(name, static))

    def _observer(self, point: str, static: list[str]) -> Callable[[str, torch.Tensor], None]:
        """The hook callback of one MLA point: each static branch's recall window, merged."""
        ratios = dict(MLA.branches)

        def observe(branch: str, tensor: torch.Tensor) -> None:
            if branch not in static:
                return
            low, high = recall_window(head_samples(tensor.detach()), ratios[branch])
            key = (point, branch)
            self._ranges[key] = merge_range(self._ranges[key], low, high)

        return observe

    def after_layer(self, ctx: RunContext, layer: DecoderLayer) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        if ctx.dist.active:
            self._merge_processes(ctx)
        tensors: dict[str, torch.Tensor] = {}
        for name, _module, branches in self._points(layer):
            schemes: dict[str, tuple[str, bool]] = {}
            for branch in branches:
                qconfig = self._config_of(branch)
                assert qconfig is not None
                dynamic = qconfig.scope == QScope.PER_TOKEN
                dtype_name = quant_type_name(qconfig.dtype.value)
                schemes[branch_letter(branch)] = (dtype_name, dynamic)
                if dynamic:
                    continue
                found = self._ranges.get((name, branch))
                if found is None:
                    raise QuantizationError(
                        f"fa3_quant: {name}.{branch} saw no calibration data (the calibration "
                        "forward did not reach this attention)"
                    )
                scale = PER_HEAD_SCALES[qconfig.dtype](*found)
                for leaf, tensor in static_tensors(scale, dtype_name).items():
                    tensors[f"{name}.{branch}.{leaf}"] = tensor
                self._record.static = True
            if schemes:
                self._record.quant_types[name] = point_quant_type(schemes)
                logger.debug("fa3_quant: %s %s", name, self._record.quant_types[name])
        if tensors:
            self._record.tensors[layer.name] = tensors
        self._ranges = {}

    def _merge_processes(self, ctx: RunContext) -> None:
        """Each process saw its share of the samples: the range is the min / max over all."""
        mine = {k: None if v is None else (v[0].cpu(), v[1].cpu()) for k, v in self._ranges.items()}
        merged: dict[tuple[str, str], Range | None] = dict.fromkeys(mine)
        for ranges in ctx.dist.all_gather_object(mine):
            for key, found in ranges.items():
                if found is not None:
                    merged[key] = merge_range(merged[key], *found)
        self._ranges = merged
