"""``quarot``: rotate the residual stream by a Hadamard matrix, folded into the weights (offline).

Sample yaml (msModelSlim's fields and defaults)::

    spec:
      process:
        - type: quarot          # online: false, block_size: -1, export_extra_info: true
        - type: linear_quant
          qconfig: {...}

What it changes, before any statistics are gathered (no calibration needed): in ``setup`` the
input embedding (``E @ R``), the final norm folded into the output head and the head rotated
(``W diag(g) @ R``, the norm's scale set to ones); the head is untied from the embedding first
when the model ties them, and the export's ``config.json`` then says
``tie_word_embeddings: false``. In ``before_layer`` each decoder layer: the attention and MLP
norms folded into the linears reading them (q/k/v, gate/up), those rotated on their input
(``W @ R``), o_proj and down_proj on their output (``R.T @ W``, bias too), and the value and
attention-output projections once more per attention head (a Hadamard matrix as wide as a head's
value; DeepSeek's MLA: the value rows of kv_b_proj and o_proj's input). The
model computes the same outputs, to float rounding; its activations have flatter channels, which
quantize better. The matrices are msModelSlim's construction (:mod:`msquant.quant.rotation`).

``online_quarot`` and ``online: true`` (rotations applied at run time) are refused: see
:data:`~msquant.processors.quarot.config.ONLINE_REFUSAL`.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from msquant import ConfigIssue, QuantizationError
from msquant.plugin import (
    DecoderLayer,
    OutputHeadStage,
    Processor,
    ProcessorConfig,
    RotationLayout,
    RunContext,
    TransformedExport,
    adapter_for,
    fuse_norm_into_linear,
    hadamard_core_order,
    rotate_input,
    rotate_output,
    rotation_for,
)
from msquant.processors.quarot.config import (
    ONLINE_REFUSAL,
    OnlineQuaRotConfig,
    QuaRotConfig,
    quarot_issues,
)
from msquant.processors.quarot.fingerprint import (
    GLOBAL_ROTATION,
    OPTIONAL_SCOPE,
    check_rotation_record,
    rotation_record,
)

__all__ = ["OnlineQuaRot", "QuaRot", "check_rms_norm", "size_problems"]

logger = logging.getLogger(__name__)


def size_problems(layout: RotationLayout, block_size: int) -> list[str]:
    """Why the rotations of ``layout``'s widths cannot be built (empty when they can)."""
    problems = []
    sizes = [("hidden size", layout.hidden_size)]
    sizes += [
        ("head_dim" if width == layout.head_dim else "per-head value width (v_head_dim)", width)
        for width in layout.head_widths
    ]
    for what, size in sizes:
        if block_size != -1:
            if size % block_size:
                problems.append(
                    f"quarot: block_size {block_size} does not divide the {what} {size}; use a "
                    f"power of two dividing it, or -1"
                )
        elif hadamard_core_order(size) is None:
            problems.append(
                f"quarot: no Hadamard matrix of the {what} {size} (msquant builds sizes k * 2^m "
                "with k a power of two or a Paley order); set block_size to a power of two "
                f"dividing {size}"
            )
    return problems


def _compute_dtype(weight: torch.Tensor) -> torch.dtype:
    """float32 (msModelSlim's arithmetic), float64 for float64 weights."""
    return torch.float64 if weight.dtype == torch.float64 else torch.float32


def check_rms_norm(module: nn.Module, name: str, offset: float = 0.0) -> None:
    """Refuse a norm that does not compute ``x / rms(x) * (offset + weight)`` (an RMSNorm, whose
    gain the model adapter says is stored as ``weight`` or, ``offset`` 1, as ``weight`` minus
    one): folding its scale and rotating its input would change the model's outputs (LayerNorm
    subtracts the mean; a ``1 + weight`` norm the adapter does not declare is refused too).

    :raises QuantizationError: naming the module and its class.
    """
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1:
        raise QuantizationError(f"quarot: {name} has no per-channel scale (weight) to fold")
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6))
    generator = torch.Generator().manual_seed(0)
    probe = torch.randn(3, weight.shape[0], generator=generator).to(weight.device, weight.dtype)
    with torch.no_grad():
        got = module(probe).to(torch.float64)
        x = probe.to(torch.float64)
        expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + float(eps))
        expected = expected * (weight.to(torch.float64) + offset)
    tolerance = 1e-2 if weight.element_size() < 4 else 1e-4
    if not torch.allclose(got, expected, rtol=tolerance, atol=tolerance):
        gain = "weight" if offset == 0 else f"({offset:g} + weight)"
        raise QuantizationError(
            f"quarot: {name} ({type(module).__name__}) does not compute x / rms(x) * {gain} (an "
            "RMSNorm, as the model adapter declares), so its scale cannot be folded into the next "
            "linears and a rotation would change the model's outputs; quarot supports models "
            "with RMSNorm layers (Llama, Qwen2/3, Mistral, the MoE families in docs/rotation.md), "
            "and a model adapter declares norms that scale by 1 + weight (norm_scale_offset)"
        )


class QuaRot(Processor):
    """Offline Hadamard rotation of the residual stream (see the module doc)."""

    type_name = "quarot"
    config_class = QuaRotConfig
    stage = "process"
    # Not resumable: a resumed run rebuilds finished layers from their quantized linears alone,
    # which would leave those layers' norms and float linears unrotated in memory.
    resumable = False
    transforms_weights = True
    config: QuaRotConfig

    @classmethod
    def check_config(cls, config: ProcessorConfig) -> list[ConfigIssue]:
        assert isinstance(config, QuaRotConfig)
        return quarot_issues(config)

    def check_model(self, model: nn.Module, layers: list[DecoderLayer]) -> list[str]:
        layout, problems = adapter_for(model).rotation_layout(model, layers)
        if layout is None:
            return [f"quarot: {problem}" for problem in problems]
        return size_problems(layout, self.config.block_size)

    def setup(self, ctx: RunContext) -> None:
        layout, problems = adapter_for(ctx.model).rotation_layout(ctx.model, ctx.layers)
        if layout is None:
            raise QuantizationError("quarot: " + "; ".join(problems))
        self.layout = layout
        model = ctx.model
        embedding = model.get_submodule(layout.embedding)
        # float32 matrices (msModelSlim's, bit for bit); float64 ones for a float64 model
        dtype = _compute_dtype(_weight(embedding))
        self.rotation = rotation_for(layout.hidden_size, self.config.block_size, dtype=dtype)
        self.head_rotations = {
            width: rotation_for(width, self.config.block_size, dtype=dtype)
            for width in layout.head_widths
        }
        head = model.get_submodule(layout.head)
        norm = model.get_submodule(layout.final_norm)
        check_rms_norm(norm, layout.final_norm, layout.norm_offset)
        with torch.no_grad():
            if layout.tied or _weight(head) is _weight(embedding):
                self._untie(ctx, head, embedding)
            _rotate_input(embedding, self.rotation)
            self._fold_norm(norm, [head], layout.norm_offset)
            _rotate_input(head, self.rotation)
        if self.config.export_extra_info:
            rotation = self.rotation.to(torch.float32)
            ctx.optional_tensors[OPTIONAL_SCOPE] = {GLOBAL_ROTATION: rotation}
        ctx.transforms.describe(
            self.type_name,
            **rotation_record(
                layout.hidden_size, self.config.block_size, self.rotation, self.head_rotations
            ),
        )
        for name in (layout.embedding, layout.final_norm, layout.head):
            self._fingerprint(ctx, name)
        logger.info(
            "quarot: rotating the residual stream (width %d, block_size %d)%s",
            layout.hidden_size,
            self.config.block_size,
            f" and the value/output projections per head (width {layout.head_widths})"
            if layout.rotates_heads
            else "",
        )

    def before_layer(self, ctx: RunContext, layer: DecoderLayer) -> None:
        if isinstance(layer, OutputHeadStage):
            return  # the head was rotated in setup
        found = self.layout.layers[layer.index]
        model = ctx.model
        with torch.no_grad():
            offset = self.layout.norm_offset
            for entry in found.norms:
                norm = model.get_submodule(entry.norm)
                check_rms_norm(norm, entry.norm, offset)
                readers = [model.get_submodule(name) for name in entry.readers]
                self._fold_norm(norm, readers, offset)
            for name in found.writers:
                _rotate_output(model.get_submodule(name), self.rotation)
            for entry in found.norms:
                for name in entry.readers:
                    _rotate_input(model.get_submodule(name), self.rotation)
            for value, output in found.value_output:
                head = self.head_rotations[found.head_width]
                _rotate_output(model.get_submodule(value), _after_rows(head, found.value_skip))
                _rotate_input(model.get_submodule(output), head)
        for entry in found.norms:  # set to the constant 1 - offset
            self._fingerprint(ctx, entry.norm)

    def _fingerprint(self, ctx: RunContext, module: str) -> None:
        """Record the weight quarot left ``module`` with (``msquant verify`` checks it)."""
        weight = _weight(ctx.model.get_submodule(module))
        ctx.transforms.fingerprint(self.type_name, ctx.disk_name(f"{module}.weight"), weight)

    @classmethod
    def check_transform(cls, record: dict[str, Any], export: TransformedExport) -> list[str]:
        return check_rotation_record(record, export)

    @staticmethod
    def _fold_norm(norm: nn.Module, readers: list[nn.Module], offset: float = 0.0) -> None:
        """Fold the norm's gain (``offset + weight``) into the linears reading it, then make the
        gain one (the weight ``1 - offset``)."""
        scale = _weight(norm)
        gain = scale.data if offset == 0 else scale.data.to(torch.float64) + offset
        for reader in readers:
            weight = _weight(reader)
            weight.data = fuse_norm_into_linear(weight.data, gain, _compute_dtype(weight))
        scale.data.fill_(1.0 - offset)

    @staticmethod
    def _untie(ctx: RunContext, head: nn.Module, embedding: nn.Module) -> None:
        """Give the head its own weight (rotation makes it differ from the embedding) and record
        ``tie_word_embeddings: false`` for the exported config."""
        head.weight = nn.Parameter(_weight(embedding).detach().clone(), requires_grad=False)
        config = getattr(ctx.model, "config", None)
        for holder in (config, getattr(config, "text_config", None)):
            if holder is not None and hasattr(holder, "tie_word_embeddings"):
                holder.tie_word_embeddings = False
        ctx.config_updates["tie_word_embeddings"] = False
        logger.info("quarot: the output head is untied from the input embeddings")


def _weight(module: nn.Module, attribute: str = "weight") -> torch.Tensor:
    """The module's ``weight`` (or ``attribute``) tensor, refused when it has none."""
    tensor = getattr(module, attribute, None)
    if not isinstance(tensor, torch.Tensor):
        raise QuantizationError(f"quarot: {type(module).__name__} has no {attribute} to rotate")
    return tensor


def _after_rows(rotation: torch.Tensor, skip: int) -> torch.Tensor:
    """``rotation`` after ``skip`` unrotated rows (an identity block first): one head's block of
    a value projection that writes other rows before the head's value (MLA's k_nope)."""
    if skip == 0:
        return rotation
    return torch.block_diag(torch.eye(skip, dtype=rotation.dtype), rotation)


def _rotate_input(module: nn.Module, rotation: torch.Tensor) -> None:
    """A linear reading the rotated stream (or the embedding producing it): ``W @ R``."""
    weight = _weight(module)
    weight.data = rotate_input(weight.data, rotation, _compute_dtype(weight))


def _rotate_output(linear: nn.Module, rotation: torch.Tensor) -> None:
    """A linear writing the rotated stream: ``R.T @ W``, ``R.T @ b``."""
    weight = _weight(linear)
    bias = linear.bias if isinstance(linear.bias, torch.Tensor) else None
    data = None if bias is None else bias.data
    rotated, rotated_bias = rotate_output(weight.data, data, rotation, _compute_dtype(weight))
    weight.data = rotated
    if bias is not None and rotated_bias is not None:
        bias.data = rotated_bias


class OnlineQuaRot(Processor):
    """``online_quarot``: validated with msModelSlim's fields, then refused (run-time rotation
    has no consumer; :data:`ONLINE_REFUSAL`)."""

    type_name = "online_quarot"
    config_class = OnlineQuaRotConfig
    stage = "process"

    @classmethod
    def check_config(cls, config: ProcessorConfig) -> list[ConfigIssue]:
        return [ConfigIssue("type", f"online_quarot (run-time rotation) {ONLINE_REFUSAL}")]
