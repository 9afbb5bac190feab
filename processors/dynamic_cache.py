"""``dynamic_cache``: the int8 KV cache ("C8"), msModelSlim's processor of that name.

Sample yaml (as msModelSlim 26.1.0's W8A8C8 best practices write it)::

    spec:
      process:
        - type: linear_quant
          qconfig: {...}
        - type: dynamic_cache
          qconfig: {scope: per_channel, dtype: int8, symmetric: true, method: minmax}
          include: ["*"]            # globs on the attention modules' names
          exclude: []
      save:
        - type: ascendv1_saver

What is calibrated is what each selected attention writes into its KV cache: the keys after the
key norm and the rotary embedding, the values as ``v_proj`` computes them. Each channel
(``kv_head * head_dim + dim``) gets a symmetric int8 scale over every calibration token
(:mod:`msquant.processors.kv_cache_quant`); the Ascend export stores it as
``<attention>.k_proj.kv_cache_scale`` / ``kv_cache_offset`` (and ``v_proj``'s), typed ``C8``, with
the globals ``kv_cache_type: C8`` and ``kv_quant_type: C8``.

The states are observed as msModelSlim observes them: through the layer as quantized (the
processors before this one in ``spec.process`` applied), on inputs computed by the already
quantized previous layers (``calibrate_on_quantized``; the runner runs each layer once more after
its ``after_layer``, and this processor observes that forward, handing the attention a cache
object that records what it stores). Two differences from msModelSlim 26.1.0, on purpose:

* the range is taken over every calibration token; msModelSlim's per-channel observer restarts at
  every forward, so its scales are those of the last calibration sample alone;
* the layers before the cache quantize their input per token (W8A8_DYNAMIC, the prefill of
  W8A8_MIX) as the deployed kernels do; msModelSlim's fake-quantized W8A8_DYNAMIC / W8A8_MIX linears
  take one scale per *input column* over the sample's tokens, so its keys and values differ from
  the deployed model's by that rounding.

Where the keys and values come from is architecture knowledge
(:mod:`msquant.processors.adapters.kv_cache`); a ``model_type`` not listed there is refused with
the layer named, and so is an attention whose forward does not call the cache once with its own
``layer_idx`` and states that fit ``k_proj`` / ``v_proj``.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Sequence
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from msquant.plugin import (
    ConfigIssue,
    DecoderLayer,
    KVCacheReport,
    Processor,
    ProcessorConfig,
    QDType,
    QScope,
    QuantizationError,
    RunContext,
)
from msquant.plugin.model import is_selected, unmatched_patterns
from msquant.processors.adapters.kv_cache import KV_CACHE_LAYOUTS, KVCacheLayout, kv_cache_layout
from msquant.processors.kv_cache_quant import KVRange

__all__ = ["DynamicCacheConfig", "DynamicCacheProcessor", "KVCacheQConfig"]

logger = logging.getLogger(__name__)

#: The description type of the KV cache's tensors (the Ascend saver's ``tensor_kinds``).
C8 = "C8"
IMPLEMENTED = "qconfig {dtype: int8, scope: per_channel, symmetric: true, method: minmax}"


class KVCacheQConfig(BaseModel):
    """``qconfig`` of ``dynamic_cache`` (msModelSlim's ``QConfig``: every field required)."""

    model_config = ConfigDict(extra="forbid", use_enum_values=False)

    dtype: QDType = Field(description="Integer type of the cache (int8).")
    scope: QScope = Field(description="Granularity: per_channel (one scale per head dimension).")
    symmetric: bool = Field(description="Symmetric (offset 0) quantization.")
    method: str = Field(description="Range observer (minmax).")
    ext: dict[str, Any] = Field(default_factory=dict, description="Method-specific options.")


class DynamicCacheConfig(ProcessorConfig):
    """Config of ``dynamic_cache``."""

    type: Literal["dynamic_cache"] = "dynamic_cache"
    qconfig: KVCacheQConfig
    include: list[str] = Field(
        default_factory=list, description="Globs on attention module names; empty = all."
    )
    exclude: list[str] = Field(default_factory=list, description="Globs that win over include.")


class DynamicCacheProcessor(Processor):
    """Calibrates the int8 KV cache of the selected attentions (module docstring)."""

    type_name = "dynamic_cache"
    config_class = DynamicCacheConfig
    config: DynamicCacheConfig
    requires_calibration = True
    calibrate_on_quantized = True

    def __init__(self, config: ProcessorConfig) -> None:
        super().__init__(config)
        self._layout: KVCacheLayout | None = None
        self._pending: list[_KVCacheRecorder] = []

    @classmethod
    def check_config(cls, config: ProcessorConfig) -> list[ConfigIssue]:
        assert isinstance(config, DynamicCacheConfig)
        q = config.qconfig
        given = (
            f"qconfig {{dtype: {q.dtype.value}, scope: {q.scope.value}, "
            f"symmetric: {str(q.symmetric).lower()}, method: {q.method}}}"
        )
        issues = []
        if q.scope is not QScope.PER_CHANNEL:
            # msModelSlim refuses every other scope too ("only supports per_channel")
            issues.append(ConfigIssue("qconfig.scope", f"{given}: only per_channel is supported"))
        elif q.dtype is not QDType.INT8 or not q.symmetric or q.method != "minmax":
            issues.append(
                ConfigIssue("qconfig", f"{given} is not implemented; implemented: {IMPLEMENTED}")
            )
        if q.ext:
            issues.append(
                ConfigIssue("qconfig.ext", f"no ext option is implemented, got {sorted(q.ext)}")
            )
        return issues

    # --- which attentions -------------------------------------------------------------------

    def _attentions(
        self, model: nn.Module, layers: list[DecoderLayer]
    ) -> tuple[list[tuple[str, nn.Module]], list[str]]:
        """The selected attention modules ``(name, module)`` and the problems found."""
        model_type = str(getattr(getattr(model, "config", None), "model_type", "unknown"))
        layout = kv_cache_layout(model_type)
        if layout is None:
            first = f"{layers[0].name}: " if layers else ""
            return [], [
                f"dynamic_cache: {first}msquant does not know where model_type {model_type!r} "
                "computes what its KV cache stores, so it cannot name the k_proj / v_proj the "
                "C8 scales belong to; no KV-cache adapter for it in "
                "msquant/processors/adapters/kv_cache.py (known: "
                f"{', '.join(sorted(KV_CACHE_LAYOUTS))})"
            ]
        self._layout = layout
        found, problems = [], []
        include = self.config.include or ["*"]
        for layer in layers:
            name = f"{layer.name}.{layout.attention}"
            try:
                attention = layer.module.get_submodule(layout.attention)
            except AttributeError:
                problems.append(f"dynamic_cache: {layer.name} has no {layout.attention} module")
                continue
            if not is_selected(name, include, self.config.exclude):
                continue
            missing = [
                part
                for part in (layout.key, layout.value)
                if not isinstance(getattr(attention, part, None), nn.Module)
            ]
            if missing or _cache_argument(attention) is None:
                what = f"no {', '.join(missing)}" if missing else "no cache argument"
                problems.append(
                    f"dynamic_cache: {name} ({type(attention).__name__}) has {what}, unlike the "
                    f"{model_type} layout msquant knows (msquant/processors/adapters/kv_cache.py)"
                )
                continue
            found.append((name, attention))
        names = [f"{layer.name}.{layout.attention}" for layer in layers]
        for pattern in unmatched_patterns(names, [p for p in include if p != "*"]):
            logger.warning("dynamic_cache: include pattern %r matches no attention", pattern)
        return found, problems

    def plan_kv_caches(
        self, model: nn.Module, layers: Sequence[DecoderLayer]
    ) -> dict[str, str | None]:
        """``msquant plan``: every decoder layer's attention, ``C8`` when selected (none for a
        ``model_type`` without a KV-cache layout: ``check_model`` reports it)."""
        layout = kv_cache_layout(
            str(getattr(getattr(model, "config", None), "model_type", "unknown"))
        )
        if layout is None:
            return {}
        selected = {name for name, _ in self._attentions(model, list(layers))[0]}
        names = [f"{layer.name}.{layout.attention}" for layer in layers]
        return {name: C8 if name in selected else None for name in names}

    def check_model(self, model: nn.Module, layers: list[DecoderLayer]) -> list[str]:
        found, problems = self._attentions(model, layers)
        if not found and not problems:
            problems.append("dynamic_cache: include / exclude select no attention module")
        return problems

    # --- the run ----------------------------------------------------------------------------

    def setup(self, ctx: RunContext) -> None:
        if ctx.dist.world_size > 1:
            raise QuantizationError(
                "dynamic_cache: the KV-cache range is gathered in one process (as msModelSlim's "
                "processor, which does not support distributed runs); run it in one process"
            )
        _, problems = self._attentions(ctx.model, ctx.layers)
        if problems:
            raise QuantizationError("\n".join(problems))

    def before_layer(self, ctx: RunContext, layer: DecoderLayer) -> None:
        self._finish(ctx)

    def after_layer(self, ctx: RunContext, layer: DecoderLayer) -> None:
        """Hook the layer's selected attentions: the runner's next forward over the layer (it
        calibrates on quantized outputs) runs through the processed layer and is observed."""
        found, _ = self._attentions(ctx.model, [layer])
        for name, attention in found:
            self._pending.append(_KVCacheRecorder(name, attention))

    def finalize(self, ctx: RunContext) -> None:
        self._finish(ctx)

    def _finish(self, ctx: RunContext) -> None:
        """Turn the observed ranges into the export's C8 tensors."""
        layout = self._layout
        for recorder in self._pending:
            recorder.remove()
            assert layout is not None
            keys, values = recorder.ranges(layout)
            tensors = []
            for part, observed in ((layout.key, keys), (layout.value, values)):
                scale, offset = observed.qparams()
                prefix = ctx.disk_name(f"{recorder.name}.{part}")
                for suffix, tensor in (("kv_cache_scale", scale), ("kv_cache_offset", offset)):
                    ctx.export_tensors[f"{prefix}.{suffix}"] = (C8, tensor)
                    tensors.append(f"{prefix}.{suffix}")
            ctx.report.add_kv_cache(
                KVCacheReport(
                    name=recorder.name,
                    scheme=C8,
                    tensors=tensors,
                    channels=int(scale.numel()),
                    tokens=keys.tokens,
                    key_absmax=keys.absmax(),
                    value_absmax=values.absmax(),
                )
            )
        self._pending.clear()


def _cache_argument(attention: nn.Module) -> str | None:
    """The name of the attention forward's cache argument (transformers 5: ``cache``, 4:
    ``past_key_values``), None when it takes none."""
    parameters = inspect.signature(attention.forward).parameters
    return next((n for n in ("cache", "past_key_values") if n in parameters), None)


class _KVCacheRecorder:
    """Hands one attention a cache that records what it stores, for the forwards until
    :meth:`remove`; the states are returned unchanged."""

    def __init__(self, name: str, attention: nn.Module) -> None:
        self.name = name
        self.attention = attention
        self.layer_idx = getattr(attention, "layer_idx", None)
        self.keys = KVRange()
        self.values = KVRange()
        self.calls = 0
        self.forwards = 0
        self.problems: list[str] = []
        argument = _cache_argument(attention)
        assert argument is not None

        def inject(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            self.forwards += 1
            return args, {**kwargs, argument: self}

        self._handle = attention.register_forward_pre_hook(inject, with_kwargs=True)

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *_: Any,
        **__: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The cache interface the attention calls: record, store nothing."""
        self.calls += 1
        if layer_idx != self.layer_idx:
            self.problems.append(
                f"the cache was updated for layer {layer_idx}, not {self.layer_idx}"
            )
        self.keys.observe(key_states)
        self.values.observe(value_states)
        return key_states, value_states

    def remove(self) -> None:
        self._handle.remove()

    def ranges(self, layout: KVCacheLayout) -> tuple[KVRange, KVRange]:
        """The observed key and value ranges, checked against the attention's projections.

        :raises QuantizationError: naming the attention when what it cached cannot be proven to
            be ``k_proj`` / ``v_proj``'s output.
        """
        problems = list(self.problems)
        if self.forwards == 0:
            problems.append("no calibration forward reached it")
        elif self.calls != self.forwards:
            problems.append(f"{self.forwards} forward(s) updated the cache {self.calls} time(s)")
        for part, observed in ((layout.key, self.keys), (layout.value, self.values)):
            features = getattr(getattr(self.attention, part), "out_features", None)
            channels = None if observed.min_val is None else observed.min_val.numel()
            if channels is not None and channels != features:
                problems.append(
                    f"the cached {part} states have {channels} channels, {part} has "
                    f"{features} output features"
                )
        if problems:
            raise QuantizationError(
                f"dynamic_cache: {self.name}: {'; '.join(problems)}; msquant cannot prove what "
                "this attention caches comes from its k_proj / v_proj "
                "(msquant/processors/adapters/kv_cache.py)"
            )
        return self.keys, self.values
