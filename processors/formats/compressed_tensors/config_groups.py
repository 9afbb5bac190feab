"""The ``config_groups`` of a compressed-tensors ``quantization_config``, parsed and checked.

Split from :mod:`~msquant.processors.formats.compressed_tensors.reader`: a group maps ``targets``
to a weight scheme (``pack-quantized`` weight-only, ``int-quantized`` int8 W8A8 with input
activations, ``float-quantized`` FP8 W8A8, ``mxfp8-quantized`` / ``mxfp4-pack-quantized`` MX with
dynamic group-32 activations of the same type); each rule compressed-tensors, vLLM and
transformers enforce on a group's arguments is checked here and reported to the reader's findings with the key's path.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from msquant.plugin import Findings
from msquant.plugin.numerics import value_type_named
from msquant.processors.formats.compressed_tensors.float_quantized import (
    FLOAT_QUANTIZED,
    FP8_VALUE_TYPE,
    float_group_problems,
)
from msquant.processors.formats.compressed_tensors.int_quantized import INT_QUANTIZED, input_scheme
from msquant.processors.formats.compressed_tensors.mx_quantized import (
    BLOCK,
    MX_FORMAT_TYPES,
    mx_group_problems,
)

__all__ = ["CTScheme", "ConfigGroup", "PACK_QUANTIZED", "parse_config_groups"]

PACK_QUANTIZED = "pack-quantized"
ARG_KEYS = {
    "num_bits",
    "type",
    "symmetric",
    "group_size",
    "strategy",
    "block_structure",
    "dynamic",
    "actorder",
    "scale_dtype",
    "zp_dtype",
    "observer",
    "observer_kwargs",
}
ALLOWED_ACTORDER = (None, "weight", "static")


@dataclass(frozen=True)
class CTScheme:
    """The weight scheme of one config group."""

    group: str
    bits: int
    symmetric: bool
    strategy: str  # channel | group
    group_size: int | None
    #: int8 activations (``int-quantized``): ``tensor`` (static) or ``token`` (dynamic); None
    #: for weight-only ``pack-quantized``.
    input_strategy: str | None = None
    input_symmetric: bool = True
    #: The float value type of weights and activations (``fp8_e4m3``: ``float-quantized``;
    #: ``mxfp8`` / ``mxfp4``: MX, ``input_strategy`` ``group``); None for integers.
    value_type: str | None = None

    @property
    def is_mx(self) -> bool:
        """Whether the group is MX (``mxfp8-quantized`` / ``mxfp4-pack-quantized``)."""
        return self.value_type in MX_FORMAT_TYPES.values()

    def key(self) -> Hashable:
        """What two fused shards must share (the group name does not matter)."""
        return (
            self.bits,
            self.symmetric,
            self.strategy,
            self.group_size,
            self.input_strategy,
            self.input_symmetric,
            self.value_type,
        )

    def describe(self) -> str:
        """E.g. ``int4 group 32 asym (group_0)``, ``int8 per-channel sym a8 token (group_0)``,
        ``fp8_e4m3 per-channel a fp8_e4m3 token (group_0)``."""
        if self.is_mx:
            return (
                f"{self.value_type} block {BLOCK} a {self.value_type} block {BLOCK} ({self.group})"
            )
        if self.value_type is not None:
            return f"{self.value_type} per-channel a {self.value_type} token ({self.group})"
        scope = "per-channel" if self.strategy == "channel" else f"group {self.group_size}"
        act = ""
        if self.input_strategy is not None:
            kind = (
                ""
                if self.input_strategy == "token"
                else (" sym" if self.input_symmetric else " asym")
            )
            act = f" a8 {self.input_strategy}{kind}"
        return f"int{self.bits} {scope} {'sym' if self.symmetric else 'asym'}{act} ({self.group})"


@dataclass(frozen=True)
class ConfigGroup:
    """One ``config_groups`` entry: its name, targets and parsed weight scheme."""

    name: str
    targets: tuple[str, ...]
    scheme: CTScheme | None


def parse_config_groups(qconfig: dict[str, Any], findings: Findings) -> list[ConfigGroup]:
    """The ``config_groups`` of ``qconfig`` with their weight schemes (None where a group is
    refused; every problem is reported to ``findings``)."""
    groups = qconfig.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        findings.error("config.json quantization_config lacks config_groups")
        return []
    found = []
    for name, group in groups.items():
        where = f"quantization_config.config_groups.{name}"
        if not isinstance(group, dict):
            findings.error(f"{where} must be an object")
            continue
        targets = group.get("targets")
        if not isinstance(targets, list) or not targets:
            findings.error(f"{where}.targets must be a non-empty list")
            targets = []
        found.append(
            ConfigGroup(
                name, tuple(str(t) for t in targets), _group_scheme(qconfig, name, group, findings)
            )
        )
    return found


def _group_scheme(
    qconfig: dict[str, Any], name: str, group: dict[str, Any], findings: Findings
) -> CTScheme | None:
    where = f"quantization_config.config_groups.{name}"
    group_format = group.get("format") or qconfig.get("format")
    if group_format == INT_QUANTIZED:
        return _int_group_scheme(name, group, where, findings)
    if group_format == FLOAT_QUANTIZED:
        problems = float_group_problems(group)
        if problems:
            findings.error(
                f"{where}: {FLOAT_QUANTIZED} is verified for FP8 W8A8 (fp8 per-channel weights, "
                f"dynamic per-token fp8 activations): " + "; ".join(problems)
            )
            return None
        return CTScheme(name, 8, True, "channel", None, "token", True, FP8_VALUE_TYPE)
    if group_format in MX_FORMAT_TYPES:
        value_type = MX_FORMAT_TYPES[group_format]
        problems = mx_group_problems(group, value_type)
        if problems:
            findings.error(
                f"{where}: {group_format} is verified for {value_type} weights with dynamic "
                f"{value_type} activations in groups of 32: " + "; ".join(problems)
            )
            return None
        bits = value_type_named(value_type).bits
        return CTScheme(name, bits, True, "group", BLOCK, "group", True, value_type)
    if group_format != PACK_QUANTIZED:
        findings.error(
            f"{where}: format {group_format!r} is not verified by msquant verify "
            f"(it reads {PACK_QUANTIZED} weight-only, {INT_QUANTIZED} int8 W8A8, "
            f"{FLOAT_QUANTIZED} FP8 W8A8 and {', '.join(MX_FORMAT_TYPES)} MX checkpoints)"
        )
        return None
    for key in ("input_activations", "output_activations"):
        if group.get(key) is not None:
            findings.error(
                f"{where}.{key} is set: activation quantization is not verified by msquant verify"
            )
            return None
    weights = group.get("weights")
    if not isinstance(weights, dict):
        findings.error(f"{where}.weights must be an object")
        return None
    return _weight_args(name, weights, f"{where}.weights", findings)


def _int_group_scheme(
    name: str, group: dict[str, Any], where: str, findings: Findings
) -> CTScheme | None:
    """An ``int-quantized`` group: int8 per-channel symmetric weights with int8 activations
    (what vLLM's CompressedTensorsW8A8Int8 loads and msquant writes)."""
    if group.get("output_activations") is not None:
        findings.error(f"{where}.output_activations is set: not verified by msquant verify")
        return None
    weights = group.get("weights")
    if not isinstance(weights, dict):
        findings.error(f"{where}.weights must be an object")
        return None
    scheme = _weight_args(name, weights, f"{where}.weights", findings)
    if scheme is None:
        return None
    if (scheme.bits, scheme.symmetric, scheme.strategy) != (8, True, "channel"):
        findings.error(
            f"{where}: {INT_QUANTIZED} with activations is verified for int8 per-channel "
            f"symmetric weights (W8A8), got {scheme.describe()}"
        )
        return None
    inputs = group.get("input_activations")
    if inputs is None:
        findings.error(
            f"{where}: {INT_QUANTIZED} without input_activations is not verified by msquant "
            "verify (msquant writes weight-only layers pack-quantized)"
        )
        return None
    parsed = input_scheme(inputs, f"{where}.input_activations", findings)
    if parsed is None:
        return None
    return CTScheme(name, 8, True, "channel", None, *parsed)


def _weight_args(
    name: str, args: dict[str, Any], where: str, findings: Findings
) -> CTScheme | None:
    unknown = sorted(set(args) - ARG_KEYS)
    if unknown:
        findings.error(f"{where}: unknown key(s) {unknown} (compressed-tensors forbids extras)")
    bits, kind = args.get("num_bits"), args.get("type", "int")
    symmetric, group_size = args.get("symmetric", True), args.get("group_size")
    strategy = args.get("strategy") or _inferred_strategy(group_size)
    ok = not unknown
    if kind != "int" or not isinstance(bits, int) or isinstance(bits, bool) or not 1 <= bits <= 8:
        findings.error(f"{where}: expected an int type of 1 to 8 bits, got {kind} {bits!r}")
        ok = False
    if not isinstance(symmetric, bool):
        findings.error(f"{where}: symmetric must be true or false")
        ok = False
    if args.get("dynamic") not in (None, False):
        findings.error(f"{where}: dynamic weights cannot be stored packed")
        ok = False
    if args.get("actorder") not in ALLOWED_ACTORDER:
        findings.error(
            f"{where}: actorder {args.get('actorder')!r} was removed from compressed-tensors "
            "(0.20 accepts 'weight', 'static' or null; vLLM rejects the others)"
        )
        ok = False
    ok = _check_strategy(where, strategy, group_size, findings) and ok
    if not ok or not isinstance(bits, int) or not isinstance(strategy, str):
        return None
    size = group_size if strategy == "group" else None
    return CTScheme(name, bits, bool(symmetric), strategy, size)


def _check_strategy(where: str, strategy: object, group_size: object, findings: Findings) -> bool:
    if strategy == "group":
        if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size <= 0:
            findings.error(f"{where}: strategy group needs a positive group_size")
            return False
        return True
    if strategy == "channel":
        if group_size not in (None, -1):
            findings.error(f"{where}: group_size {group_size} needs strategy group")
            return False
        return True
    findings.error(
        f"{where}: strategy {strategy!r} is not verified by msquant verify (channel or group; "
        "vLLM's weight-only scheme takes only these)"
    )
    return False


def _inferred_strategy(group_size: object) -> str:
    """compressed-tensors' default: no group_size -> tensor, -1 -> channel, positive -> group."""
    if group_size is None:
        return "tensor"
    return "channel" if group_size == -1 else "group"
