"""``quarot``: rotate the residual stream by a Hadamard matrix, folded into the weights (offline).

Sample yaml (msModelSlim's fields and defaults)::

    spec:
      process:
        - type: quarot          # online: false, block_size: -1, export_extra_info: true
        - type: linear_quant
          qconfig: {...}

What it changes, before any statistics are gathered (no calibration needed): in ``setup`` the
input embedding (``E @ R``), the final norm folded into the output head and the head rotated
(``W diag(g) @ R``, the norm's scale set to ones), and for a vision-language model the
projector linears whose output joins the stream (``R.T @ W``, bias too; msModelSlim's choice,
:data:`msquant.model.vision.STREAM_FEEDERS`: the vision tower is not rotated otherwise); the
head is untied from the embedding first
when the model ties them, and the export's ``config.json`` then says
``tie_word_embeddings: false``. In ``before_layer`` each decoder layer: the attention and MLP
norms folded into the linears reading them (q/k/v, gate/up), those rotated on their input
(``W @ R``), o_proj and down_proj on their output (``R.T @ W``, bias too), and the value and
attention-output projections once more per attention head (a Hadamard matrix as wide as a head's
value; DeepSeek's MLA: the value rows of kv_b_proj and o_proj's input). The
model computes the same outputs, to float rounding; its activations have flatter channels, which
quantize better. The matrices are msModelSlim's construction (:mod:`msquant.quant.rotation`).

Every step proves itself during the run (:mod:`msquant.check`, on the run's probe tokens): each
norm's form is measured (an RMSNorm scaling by ``offset + weight``) before its gain is folded;
in ``setup`` the first layer's input must become the original one rotated and the head's logits
must stay; in ``before_layer`` each norm's output must be what its readers read and nothing else
(scaling its channels scales their inputs only), norms on a block's output (Gemma's sandwich
norms) must have one gain for every channel, and the rotated layer, fed the rotated input, must
compute the original output rotated. A model wired otherwise is refused with the layer and what
did not hold, before anything is written.

``online_quarot`` and ``online: true`` (rotations applied at run time) are refused: see
:data:`~msquant.processors.quarot.config.ONLINE_REFUSAL`.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from msquant.plugin import (
    CalibrationSize,
    ConfigIssue,
    DecoderLayer,
    Processor,
    ProcessorConfig,
    QuantizationError,
    RunContext,
    TransformCheckError,
    TransformedExport,
    adapter_for,
)
from msquant.plugin.checks import (
    FlowPair,
    FunctionCheck,
    TransformProbe,
    function_tolerance,
    in_float32,
    max_relative_error,
    prove_flow,
    shared_weight_problems,
)
from msquant.plugin.model import (
    LayerRotationLayout,
    OutputHeadStage,
    RotationLayout,
    measure_norm_form,
    norm_form_problem,
)
from msquant.plugin.numerics import (
    fuse_norm_into_linear,
    hadamard_core_order,
    rotate_input,
    rotate_output,
    rotation_for,
)
from msquant.processors.quarot.config import (
    ONCE_PER_CONFIG,
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
from msquant.processors.quarot.memory import quarot_memory

__all__ = ["OnlineQuaRot", "QuaRot", "check_rms_norm", "size_problems"]

logger = logging.getLogger(__name__)

#: What a user can do when the rotation's layout does not hold on the model.
FIX = (
    ". The rotation layout comes from the model adapter (docs/developer/add-model-adapter.md): an "
    "architecture wired otherwise needs an adapter describing it (norm_layout, rotation_layout), "
    "or run without quarot"
)
#: Rows of the random hidden states the output head's check runs on.
HEAD_CHECK_ROWS = 8


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


def check_rms_norm(module: nn.Module, name: str, offset: float | None = None) -> float:
    """The gain offset of a norm the rotation folds (``x / rms(x) * (offset + weight)``,
    measured on a synthetic input); a norm of another form (LayerNorm subtracts the mean; a
    bias) is refused, and so is one contradicting the ``offset`` the model adapter declares.

    :raises TransformCheckError: naming the module and its class.
    """
    form, problem = norm_form_problem(module, name, offset, allow_centered=False, allow_bias=False)
    if problem is not None or form is None:
        raise TransformCheckError(
            f"quarot: {problem}: its scale cannot be folded into the next linears and a rotation "
            "would change the model's outputs; quarot supports models whose norms on the residual "
            "stream are RMSNorms (scaling by weight or 1 + weight){FIX}"
        )
    return form.offset


def _uniform_gain_problem(module: nn.Module, name: str) -> str | None:
    """Why a norm on a block's output stops the rotation (None when its gain is one value for
    every channel: then it commutes with the rotation)."""
    form = measure_norm_form(module)
    if form is None or form.centered or form.has_bias:
        return f"{name} ({type(module).__name__}) is not an RMSNorm"
    gain = _weight(module).detach().to(torch.float64) + form.offset
    if float(gain.max() - gain.min()) <= 1e-6 * max(float(gain.abs().max()), 1e-30):
        return None
    return (
        f"{name} normalises a block's output before the residual add with a gain that differs "
        f"between channels ({float(gain.min()):.3g} to {float(gain.max()):.3g}): a rotation of "
        "the residual stream cannot pass through it (Gemma 2/3's sandwich norms); quarot cannot "
        "rotate this model offline"
    )


class QuaRot(Processor):
    """Offline Hadamard rotation of the residual stream (see the module doc)."""

    type_name = "quarot"
    config_class = QuaRotConfig
    stage = "process"
    # Resumable: nothing carries from one layer to the next but what setup derives again from
    # the model and the seed (the matrices, the rotated embedding and head); the checkpoint
    # holds the finished layers' rotated float tensors and the probe's hidden states.
    resumable = True
    transforms_weights = True
    once_per_config = ONCE_PER_CONFIG
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

    def memory_bytes(
        self, model: nn.Module, layer: DecoderLayer, calibration: CalibrationSize
    ) -> dict[str, int]:
        """Rotation matrices and the largest rotation's working copies (:mod:`.memory`)."""
        return quarot_memory(model, layer)

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
        offset = check_rms_norm(norm, layout.final_norm, layout.norm_offset)
        probe = ctx.probe
        first_input = None if probe is None else probe.first_layer_input()
        head_check = _HeadCheck(norm, head, layout.hidden_size)
        with torch.no_grad():
            if layout.tied or _weight(head) is _weight(embedding):
                self._untie(ctx, head, embedding)
            _rotate_input(embedding, self.rotation)
            for name in layout.feeders:  # a vision-language model's projector outputs
                _rotate_output(model.get_submodule(name), self.rotation)
            self._fold_norm(norm, [head], offset)
            _rotate_input(head, self.rotation)
        head_check.verify(self.rotation)
        if probe is not None and first_input is not None:
            self._check_first_input(probe, first_input, _weight(embedding).dtype)
        if self.config.export_extra_info:
            rotation = self.rotation.to(torch.float32)
            ctx.optional_tensors[OPTIONAL_SCOPE] = {GLOBAL_ROTATION: rotation}
        ctx.transforms.describe(
            self.type_name,
            **rotation_record(
                layout.hidden_size, self.config.block_size, self.rotation, self.head_rotations
            ),
        )
        for name in (layout.embedding, *layout.feeders, layout.final_norm, layout.head):
            self._fingerprint(ctx, name)
        logger.info(
            "quarot: rotating the residual stream (width %d, block_size %d)%s",
            layout.hidden_size,
            self.config.block_size,
            f" and the value/output projections per head (width {layout.head_widths})"
            if layout.rotates_heads
            else "",
        )

    def _check_first_input(
        self, probe: TransformProbe, before: torch.Tensor, dtype: torch.dtype
    ) -> None:
        """The first decoder layer's input must now be the original one rotated (anything the
        model applies to its embeddings besides a scalar would break that)."""
        after = probe.first_layer_input()
        rotation = self.rotation.to(after.dtype)
        error = max_relative_error(before.to(after.dtype) @ rotation, after)
        tolerance = function_tolerance(dtype)
        logger.debug("quarot: first layer input rotated (error %.3g)", error)
        if not error <= tolerance:
            raise TransformCheckError(
                f"quarot: after rotating the input embedding, the hidden states entering the first "
                f"decoder layer are not the original ones rotated (error {error:.3g} on "
                f"{probe.describe()}): the model transforms its embeddings before the first layer "
                f"(an embedding norm, a projection) in a way the rotation layout does not know{FIX}"
            )

    def before_layer(self, ctx: RunContext, layer: DecoderLayer) -> None:
        """Measure the layer's norms, prove their readers on the probe, rotate the layer and
        check that it computes the original output, rotated."""
        if isinstance(layer, OutputHeadStage):
            return  # the head was rotated in setup
        found = self.layout.layers[layer.index]
        model = ctx.model
        offsets = {
            entry.norm: check_rms_norm(
                model.get_submodule(entry.norm), entry.norm, self.layout.norm_offset
            )
            for entry in found.norms
        }
        for name in found.branch_norms:
            problem = _uniform_gain_problem(model.get_submodule(name), name)
            if problem is not None:
                raise TransformCheckError(f"quarot: {problem}")
        check = None if ctx.probe is None else self._prove(ctx.probe, model, layer, found)
        with torch.no_grad():
            for entry in found.norms:
                norm = model.get_submodule(entry.norm)
                readers = [model.get_submodule(name) for name in entry.readers]
                self._fold_norm(norm, readers, offsets[entry.norm])
            for name in found.writers:
                _rotate_output(model.get_submodule(name), self.rotation)
            for entry in found.norms:
                for name in entry.readers:
                    _rotate_input(model.get_submodule(name), self.rotation)
            for value, output in found.value_output:
                head = self.head_rotations[found.head_width]
                _rotate_output(model.get_submodule(value), _after_rows(head, found.value_skip))
                _rotate_input(model.get_submodule(output), head)
        if check is not None:
            check.verify("the rotation of its weights")
        for entry in found.norms:  # set to the constant 1 - offset
            self._fingerprint(ctx, entry.norm)

    def _prove(
        self,
        probe: TransformProbe,
        model: nn.Module,
        layer: DecoderLayer,
        found: LayerRotationLayout,
    ) -> FunctionCheck:
        """Refuse weights shared outside the layer, prove that each norm's output is what its
        readers read (and nothing else), on the probe's input un-rotated; returns the check of
        the rotated layer's output."""
        touched = [
            *(name for entry in found.norms for name in (entry.norm, *entry.readers)),
            *found.writers,
            *(name for pair in found.value_output for name in pair),
        ]
        shared = shared_weight_problems(model, layer.name, dict.fromkeys(touched))
        if shared:
            raise TransformCheckError(f"quarot: {layer.name}: " + "; ".join(shared) + FIX)
        rotation = self.rotation

        def unrotate(hidden: torch.Tensor) -> torch.Tensor:
            return hidden @ rotation.to(hidden.dtype).T

        prefix = layer.name + "."
        pairs = [
            FlowPair(
                f"norm {entry.norm.removeprefix(prefix)} -> its readers", entry.norm, entry.readers
            )
            for entry in found.norms
        ]
        reference = prove_flow(
            probe, model, pairs, self.type_name, hidden=unrotate(probe.hidden()), fix=FIX
        )
        return FunctionCheck(
            probe,
            self.type_name,
            reference,
            to_original=unrotate,
            from_transformed=unrotate,
            fix=FIX,
        )

    def _fingerprint(self, ctx: RunContext, module: str) -> None:
        """Record the weight quarot left ``module`` with (``msquant verify`` checks it)."""
        weight = _weight(ctx.model.get_submodule(module))
        ctx.transforms.fingerprint(self.type_name, ctx.disk_name(f"{module}.weight"), weight)

    @classmethod
    def check_transform(cls, record: dict[str, Any], export: TransformedExport) -> list[str]:
        return check_rotation_record(record, export)

    @staticmethod
    def _fold_norm(norm: nn.Module, readers: list[nn.Module], offset: float) -> None:
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


class _HeadCheck:
    """The output head's logits on random hidden states, before the final norm is folded into
    the head and both are rotated, and after (on the same states rotated)."""

    def __init__(self, norm: nn.Module, head: nn.Module, width: int) -> None:
        self.norm, self.head = norm, head
        generator = torch.Generator().manual_seed(0)
        self.hidden = torch.randn(HEAD_CHECK_ROWS, width, generator=generator)
        self.dtype = _weight(head).dtype
        self.before = self._logits(self.hidden)

    @torch.no_grad()
    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        device = _weight(self.head).device
        with in_float32(self.norm), in_float32(self.head):
            wide = torch.float64 if self.dtype == torch.float64 else torch.float32
            out = self.head(self.norm(hidden.to(device, wide)))
        return out.detach().to("cpu")

    def verify(self, rotation: torch.Tensor) -> None:
        after = self._logits(self.hidden.to(rotation.dtype) @ rotation.cpu())
        error = max_relative_error(self.before, after)
        logger.debug("quarot: head logits kept (error %.3g)", error)
        if not error <= function_tolerance(self.dtype):
            raise TransformCheckError(
                f"quarot: after folding the final norm into the output head and rotating both, "
                f"the head's logits moved by {error:.3g} (relative) on random hidden states: the "
                f"final norm or the head is not what the rotation layout says{FIX}"
            )


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
