"""``linear_quant``: quantize the weights of selected linear layers (msModelSlim's processor).

Sample yaml::

    spec:
      process:
        - type: linear_quant
          qconfig:
            weight: {scope: per_channel, dtype: int8, symmetric: true, method: gptq,
                     ext: {percdamp: 0.01, block_size: 128}}
          include: ["*"]
          exclude: ["*down_proj"]

Lifecycle:

* ``check_config``: the ``(dtype, scope, method)`` combination is implemented, ``ext`` is valid for
  the method, activations are float (weight-only quantization).
* ``check_model``: ``group_size`` divides the ``in_features`` of every selected layer; include
  patterns that match no linear layer are logged.
* ``before_layer`` (``method: gptq``): a forward hook on each selected ``nn.Linear`` feeds its
  inputs to a :class:`~msquant.WeightPerChannelGPTQ` / :class:`~msquant.WeightPerGroupGPTQ`
  Hessian while the runner pushes the calibration set through the layer (float weights, as
  msModelSlim does, so every layer is calibrated on the float model's activations).
* ``after_layer``: the hooks are removed; each selected ``nn.Linear`` is quantized (round-to-nearest
  or GPTQ) and replaced by a ``QuantizedLinear`` (whose state dict is the W8A16 layout savers write).
"""

from __future__ import annotations

import logging
from functools import cached_property
from typing import Literal

import torch
from pydantic import Field, ValidationError
from torch import nn
from torch.utils.hooks import RemovableHandle
from tqdm.auto import tqdm

from msquant import (
    WEIGHT_METHODS,
    ConfigIssue,
    DecoderLayer,
    GPTQExt,
    LinearQConfig,
    MinMaxExt,
    NotImplementedYetError,
    Processor,
    ProcessorConfig,
    QDType,
    QScope,
    QuantizedLinear,
    RunContext,
    WeightPerChannelGPTQ,
    WeightPerGroupGPTQ,
    divisors,
    is_selected,
    quantize_weight_minmax,
    replace_module,
    unmatched_patterns,
)

__all__ = ["LinearQuantConfig", "LinearQuantProcessor"]

logger = logging.getLogger(__name__)


class LinearQuantConfig(ProcessorConfig):
    """Config of ``linear_quant``."""

    type: Literal["linear_quant"] = "linear_quant"
    qconfig: LinearQConfig
    include: list[str] = Field(
        default_factory=lambda: ["*"], description="Module-name globs to quantize."
    )
    exclude: list[str] = Field(
        default_factory=list, description="Module-name globs to skip (wins)."
    )


class LinearQuantProcessor(Processor):
    """Weight-only quantization of ``nn.Linear`` layers inside the decoder layers."""

    type_name = "linear_quant"
    config_class = LinearQuantConfig
    stage = "process"
    config: LinearQuantConfig

    def __init__(self, config: ProcessorConfig) -> None:
        super().__init__(config)
        self.method = self.config.qconfig.weight.method
        self.requires_calibration = self.method == "gptq"
        self._gptq: dict[str, WeightPerChannelGPTQ | WeightPerGroupGPTQ] = {}
        self._hooks: list[RemovableHandle] = []
        self._last_input: tuple[torch.Tensor, str] | None = None
        self._share_with: dict[str, str] = {}  # module -> module whose Hessian it shares

    @classmethod
    def check_config(cls, config: ProcessorConfig) -> list[ConfigIssue]:
        assert isinstance(config, LinearQuantConfig)
        issues: list[ConfigIssue] = []
        act = config.qconfig.act
        if act.dtype is not QDType.FLOAT:
            issues.append(
                ConfigIssue(
                    "qconfig.act.dtype",
                    f"activation quantization ({act.dtype.value}) is not implemented; valid: float "
                    "(weight-only, e.g. W8A16) - or omit qconfig.act",
                )
            )
        weight = config.qconfig.weight
        method = WEIGHT_METHODS.get(weight.method)
        if method is None:
            issues.append(
                ConfigIssue(
                    "qconfig.weight.method",
                    f"unknown method {weight.method!r}; valid: {', '.join(sorted(WEIGHT_METHODS))}",
                )
            )
            return issues
        if weight.dtype not in method.dtypes or weight.scope not in method.scopes:
            combos = ", ".join(
                f"({d.value}, {s.value})"
                for d in sorted(method.dtypes, key=lambda d: d.value)
                for s in sorted(method.scopes, key=lambda s: s.value)
            )
            issues.append(
                ConfigIssue(
                    "qconfig.weight",
                    f"(dtype {weight.dtype.value}, scope {weight.scope.value}) is not implemented for "
                    f"method {method.name}; implemented (dtype, scope): {combos}",
                )
            )
        try:
            method.ext_model.model_validate(weight.ext)
        except ValidationError as exc:
            for err in exc.errors(include_url=False):
                loc = ".".join(str(p) for p in err["loc"])
                message = err["msg"]
                if err["type"] == "extra_forbidden":
                    message = f"unknown {method.name} option; valid: {', '.join(method.ext_model.model_fields)}"
                issues.append(ConfigIssue(f"qconfig.weight.ext.{loc}", message))
        if "group_size" in weight.ext and weight.scope is QScope.PER_CHANNEL:
            logger.warning("qconfig.weight.ext.group_size is ignored with scope per_channel")
        return issues

    @cached_property
    def ext(self) -> MinMaxExt | GPTQExt:
        """The validated ``ext`` options of the configured method (defaults filled in)."""
        weight = self.config.qconfig.weight
        ext = WEIGHT_METHODS[weight.method].ext_model.model_validate(weight.ext)
        assert isinstance(ext, MinMaxExt | GPTQExt)
        return ext

    @property
    def group_size(self) -> int | None:
        """Group width for per_group, None for per_channel."""
        if self.config.qconfig.weight.scope is not QScope.PER_GROUP:
            return None
        return self.ext.group_size

    def selected(self, layer: DecoderLayer) -> list[tuple[str, nn.Linear]]:
        """The layer's linear modules this processor quantizes."""
        return [
            (name, module)
            for name, module in layer.named_linears()
            if is_selected(name, self.config.include, self.config.exclude)
        ]

    def check_model(self, model: nn.Module, layers: list[DecoderLayer]) -> list[str]:
        method = WEIGHT_METHODS[self.config.qconfig.weight.method]
        if not method.implemented:
            raise NotImplementedYetError(
                f"linear_quant method {method.name!r} is not implemented yet in this msquant version; "
                "use method: minmax (round-to-nearest) for now"
            )
        problems = []
        all_names = [name for layer in layers for name, _ in layer.named_linears()]
        missing = unmatched_patterns(all_names, self.config.include)
        if missing:
            logger.warning(
                "linear_quant include pattern(s) matched no decoder linear layer: %s", missing
            )
        group_size = self.group_size
        if group_size is not None:
            for layer in layers:
                for name, module in self.selected(layer):
                    if module.in_features % group_size:
                        problems.append(
                            f"{name}: group_size {group_size} does not divide in_features "
                            f"{module.in_features} (weight [{module.out_features}, {module.in_features}]); "
                            f"valid group sizes: {divisors(module.in_features)} - or exclude this layer"
                        )
        return problems

    def _new_gptq(self, name: str, in_features: int) -> WeightPerChannelGPTQ | WeightPerGroupGPTQ:
        """A GPTQ quantizer for one module, configured from ``qconfig.weight`` and its ``ext``."""
        weight_cfg = self.config.qconfig.weight
        ext = self.ext.model_dump()
        if self.group_size is None:
            ext.pop("static_groups")  # meaningless without groups
            return WeightPerChannelGPTQ.from_ext(
                weight_cfg.dtype.bits, weight_cfg.symmetric, ext, name
            )
        return WeightPerGroupGPTQ.from_ext(weight_cfg.dtype.bits, weight_cfg.symmetric, ext, name)

    def before_layer(self, ctx: RunContext, layer: DecoderLayer) -> None:
        if self.method != "gptq":
            return
        for name, module in self.selected(layer):
            self._gptq[name] = self._new_gptq(name, module.in_features)

            def accumulate(
                _: nn.Module, args: tuple[torch.Tensor, ...], __: torch.Tensor, name: str = name
            ) -> None:
                self._accumulate(name, args[0])

            self._hooks.append(module.register_forward_hook(accumulate))

    def _accumulate(self, name: str, x: torch.Tensor) -> None:
        """Feed one module's input to its Hessian, sharing one Hessian between modules that read
        the very same input tensor (q/k/v, gate/up): identical sums at a fraction of the cost.

        Sharing is decided on the first calibration batch and must hold for every later batch.
        """
        last = self._last_input
        if last is not None and last[0] is x and last[1] != name:
            owner = self._share_with.get(last[1], last[1])
            if name not in self._share_with:
                if self._gptq[name].nsamples:
                    raise RuntimeError(f"{name}: its input became shared after the first batch")
                self._share_with[name] = owner
                self._gptq[name].accumulator = self._gptq[owner].accumulator
                logger.debug("%s shares the Hessian of %s (same input)", name, owner)
            elif self._share_with[name] != owner:
                raise RuntimeError(f"{name}: its input is no longer the input of {owner}")
            return
        if name in self._share_with:
            raise RuntimeError(
                f"{name}: its input is no longer the input of {self._share_with[name]}"
            )
        self._gptq[name].add_batch(x)
        self._last_input = (x, name)

    def after_layer(self, ctx: RunContext, layer: DecoderLayer) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self._last_input = None
        self._share_with.clear()
        weight_cfg = self.config.qconfig.weight
        bits = weight_cfg.dtype.bits
        group_size = self.group_size
        modules = self.selected(layer)
        for name, module in tqdm(
            modules,
            desc=layer.name,
            unit="linear",
            leave=False,
            disable=not ctx.progress or len(modules) < 2,
        ):
            if self.method == "gptq":
                result = self._gptq.pop(name).quantize(module.weight, backend=ctx.backend)
                qweight = result.quantized
                logger.debug(
                    "%s: GPTQ loss %.4g, percdamp %.4g (%d retries), %d dead columns, %.2f s",
                    name, result.loss, result.percdamp, result.damp_retries,
                    result.dead_columns, result.seconds,
                )  # fmt: skip
            else:
                qweight = quantize_weight_minmax(
                    module.weight, bits, weight_cfg.symmetric, group_size, name=name,
                    mse=self.ext.mse_options(),
                )  # fmt: skip
            replace_module(
                ctx.model, name, QuantizedLinear.from_linear(module, qweight, self.method)
            )
