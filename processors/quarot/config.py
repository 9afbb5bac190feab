"""The configs of ``quarot`` and ``online_quarot`` (msModelSlim's fields and defaults) and their
checks without a model."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from msquant.plugin import ConfigIssue, ProcessorConfig
from msquant.plugin.numerics import is_power_of_two

__all__ = [
    "ONLINE_REFUSAL",
    "ONCE_PER_CONFIG",
    "OnlineQuaRotConfig",
    "QuaRotConfig",
    "quarot_issues",
]

#: Why run-time rotation is refused (``quarot.online: true`` and ``online_quarot``).
ONLINE_REFUSAL = (
    "is not supported: run-time rotation exports extra matrices (heads_rotation, "
    "kronecker_rotation_m / kronecker_rotation_n) that the serving engine must apply to the "
    "activations, and vLLM-Ascend 0.26.0rc1 has no code that loads or applies them (it reads only "
    "the offline rotation's optional.quarot global_rotation, to align speculative-decoding draft "
    "models), so such an export would compute wrong outputs there (docs/rotation.md). Use the "
    "offline rotation, `type: quarot` with `online: false` (the default), which folds the "
    "rotation into the weights and needs nothing at run time"
)

#: Why a config may hold one ``quarot`` entry (counted in spec.prior, spec.process and groups).
ONCE_PER_CONFIG = (
    "each quarot entry rotates the residual stream again, so the model would carry the product "
    "of the rotations while the export ships one matrix (optional/quarot.safetensors, "
    "global_rotation, which vLLM-Ascend applies to the weights of an EAGLE-3 draft model); "
    "msModelSlim 26.1.0 fails when saving such a run, or ships one entry's matrix alone when the "
    "other sets export_extra_info: false. Keep one quarot entry (docs/rotation.md)"
)


class QuaRotConfig(ProcessorConfig):
    """Config of ``quarot``: a Hadamard rotation of the residual stream folded into the weights."""

    type: Literal["quarot"] = "quarot"
    online: bool = Field(
        False,
        description="Also rotate inside the attention and MLP at run time (msModelSlim's LAOS "
        "online rotation). Refused: no serving engine msquant targets applies it.",
    )
    block_size: int = Field(
        -1,
        description="-1: one Hadamard matrix as wide as the hidden size (and one as wide as an "
        "attention head for the value/output projections); a power of two: block-diagonal "
        "copies of one Hadamard matrix of that size (it must divide the hidden size and head_dim).",
    )
    down_proj_online_layers: list[int] = Field(
        default_factory=list,
        description="Layers whose down_proj input is rotated at run time; used only with "
        "online: true (accepted for msModelSlim configs, ignored offline).",
    )
    max_tp_size: int = Field(
        4,
        description="Largest tensor-parallel size the run-time rotation must split over (a "
        "power of two); used only with online: true (accepted, ignored offline).",
    )
    export_extra_info: bool = Field(
        True,
        description="Ship the hidden-size rotation matrix with the export (Ascend savers: "
        "optional/quarot.safetensors, tensor global_rotation, named in the description's "
        "optional.quarot.rotation_map), as msModelSlim does.",
    )


class OnlineQuaRotConfig(ProcessorConfig):
    """Config of ``online_quarot`` (msModelSlim's fields; the processor is refused)."""

    type: Literal["online_quarot"] = "online_quarot"
    include: list[str] = Field(default_factory=lambda: ["*"], description="Module-name globs.")
    exclude: list[str] = Field(default_factory=list, description="Module-name globs.")
    block_size: int = Field(-1, description="Rotation block size (-1: whole width).")


def quarot_issues(config: QuaRotConfig) -> list[ConfigIssue]:
    """What is wrong with a ``quarot`` entry, one issue per field."""
    issues = []
    if config.online:
        issues.append(ConfigIssue("online", f"online: true (run-time rotation) {ONLINE_REFUSAL}"))
    if config.block_size != -1 and not is_power_of_two(config.block_size):
        issues.append(
            ConfigIssue(
                "block_size",
                f"must be -1 (the whole width) or a power of two, got {config.block_size}",
            )
        )
    if not is_power_of_two(config.max_tp_size):
        issues.append(
            ConfigIssue("max_tp_size", f"must be a power of two >= 1, got {config.max_tp_size}")
        )
    negative = [index for index in config.down_proj_online_layers if index < 0]
    if negative:
        issues.append(
            ConfigIssue("down_proj_online_layers", f"layer indices must be >= 0, got {negative}")
        )
    return issues
