"""The compressed-tensors ``quantization_config`` (pure): one config group per distinct scheme,
the most common one targeting the class ``Linear``, the others their exact module names, and the
modules left in float in ``ignore``.

A scheme is weight-only (``pack-quantized``, ``input_activations: null``), FP8 W8A8
(``float-quantized``: ``type: float`` 8-bit channel weights, ``type: float`` dynamic per-token
activations, compressed-tensors' ``FP8_DYNAMIC`` preset), MX (``mxfp8-quantized`` /
``mxfp4-pack-quantized``: ``type: float`` 8- or 4-bit weights in groups of 32 with uint8 E8M0
scales and dynamic group-32 activations of the same type, compressed-tensors' ``MXFP8`` / ``MXFP4``
presets, what vLLM's ``_is_mxfp8`` / ``_is_mxfp4`` and vLLM-Ascend's ``_is_dynamic_group_mx``
match) or int8 W8A8
(``int-quantized``, with ``input_activations`` as llm-compressor 0.14 writes them for the same
scheme: ``{num_bits: 8, type: int, symmetric, strategy: token, dynamic: true}`` for per-token
dynamic activations, ``strategy: tensor, dynamic: false`` for static per-tensor ones).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from msquant.plugin import QuantizationError, QuantizedLinear

__all__ = [
    "COMPRESSED_TENSORS_VERSION",
    "FORMAT",
    "INT_QUANTIZED",
    "MX_FORMATS",
    "MX_GROUP_SIZE",
    "MX_SCALE_DTYPE",
    "MIXED_PRECISION",
    "ACTORDER_WEIGHT",
    "WeightScheme",
    "build_quantization_config",
]

#: The compressed-tensors release this layout and config were verified against (written as
#: ``version``; compressed-tensors itself is only a test dependency).
COMPRESSED_TENSORS_VERSION = "0.20.1"
FORMAT = "pack-quantized"
#: The format of int8 weights stored unpacked beside quantized activations (vLLM's
#: ``CompressedTensorsW8A8Int8`` is chosen only for an activation-quantization format).
INT_QUANTIZED = "int-quantized"
#: The format of FP8 weights (``float8_e4m3fn`` beside a per-channel scale; vLLM's
#: ``CompressedTensorsW8A8Fp8`` with FP8 input activations).
FLOAT_QUANTIZED = "float-quantized"
#: The format of each MX value type (compressed-tensors' ``CompressionFormat``): MXFP8 elements
#: stored as ``float8_e4m3fn`` ``weight``, MXFP4 ones two per byte in ``weight_packed``.
MX_FORMATS = {"mxfp8": "mxfp8-quantized", "mxfp4": "mxfp4-pack-quantized"}
#: The MX block (compressed-tensors' ``group_size``; vLLM and vLLM-Ascend match only 32).
MX_GROUP_SIZE = 32
#: How compressed-tensors serializes the MX presets' ``scale_dtype`` (``torch.uint8``: the E8M0
#: byte); vLLM's ``_is_mxfp8`` requires it, compressed-tensors 0.17 and 0.20 parse it.
MX_SCALE_DTYPE = "torch.uint8"
#: The top-level ``format`` when the config groups use different formats (compressed-tensors'
#: name; vLLM reads each group's own ``format`` first), and whenever a group is MX: vLLM-Ascend
#: 0.30.0rc2 keeps a group's ``input_activations`` only when its format is one of vLLM's
#: activation-quantization formats (``is_activation_quantization_format`` of vLLM's
#: ``compressed_tensors/utils.py``: no MX format in 0.33 / 0.34) or the top-level one is
#: ``mixed-precision`` (``quantization/configs/compressed_tensors_config.py:128-138``); without
#: them it matches no MX scheme (``:346-364``, ``:388-389``) and refuses every MX layer
#: (``NotImplementedError``, ``:382``).
MIXED_PRECISION = "mixed-precision"
#: compressed-tensors' ``actorder`` for GPTQ act-order with static groups (alias ``static``):
#: accepted by compressed-tensors 0.20 and vLLM 0.33 / 0.34, which need no ``g_idx`` for it.
ACTORDER_WEIGHT = "weight"


@dataclass(frozen=True)
class WeightScheme:
    """One weight quantization scheme: what a compressed-tensors config group describes.

    :param num_bits: code width.
    :param symmetric: no zero point stored.
    :param group_size: group width over input columns, or ``None`` for per-channel.
    :param actorder: ``"weight"`` when GPTQ quantized the modules in act-order with static
        groups (compressed-tensors' and llm-compressor's name; the stored layout is unchanged,
        there is no ``g_idx``), else None.
    :param input_strategy: compressed-tensors' strategy of the int8 input activations:
        ``token`` (dynamic, symmetric), ``tensor`` (static, calibrated), None for float
        activations (weight-only).
    :param input_symmetric: whether static activations have no zero point.
    :param value_type: the float value type of weights and activations: ``fp8_e4m3``
        (``float-quantized``, per-channel weights, per-token activations) or ``mxfp8`` /
        ``mxfp4`` (MX: groups of 32, E8M0 scales, dynamic group-32 activations of the same
        type, ``input_strategy`` ``group``); None for integers.
    """

    num_bits: int
    symmetric: bool
    group_size: int | None
    actorder: str | None = None
    input_strategy: str | None = None
    input_symmetric: bool = True
    value_type: str | None = None

    @classmethod
    def of(cls, module: QuantizedLinear) -> WeightScheme:
        """The scheme of a quantized linear."""
        actorder = ACTORDER_WEIGHT if getattr(module, "act_order", False) else None
        act = module.act
        if module.value_type.family == "fp8":
            return cls(8, True, None, None, "token", True, module.value_type.name)
        if module.value_type.family == "mx":
            return cls(
                module.bits, True, MX_GROUP_SIZE, None, "group", True, module.value_type.name
            )
        if act is None:
            return cls(module.bits, module.symmetric, module.group_size, actorder)
        strategy = "token" if act.dynamic else "tensor"
        return cls(
            module.bits, module.symmetric, module.group_size, actorder, strategy, act.symmetric
        )

    @property
    def is_mx(self) -> bool:
        """Whether the scheme is MX (``mxfp8`` / ``mxfp4``)."""
        return self.value_type in MX_FORMATS

    @property
    def format(self) -> str:
        """The group's compression format: ``float-quantized`` for FP8, ``mxfp8-quantized`` /
        ``mxfp4-pack-quantized`` for MX, ``int-quantized`` with int8 activations, else
        ``pack-quantized``."""
        if self.value_type is not None:
            return MX_FORMATS.get(self.value_type, FLOAT_QUANTIZED)
        return FORMAT if self.input_strategy is None else INT_QUANTIZED

    def input_args(self) -> dict[str, Any] | None:
        """The ``input_activations`` entry of a config group (None for float activations)."""
        if self.input_strategy is None:
            return None
        if self.is_mx:
            return {**self.weights_args(), "dynamic": True}
        dynamic = self.input_strategy == "token"
        return {
            "num_bits": 8,
            "type": "int" if self.value_type is None else "float",
            "symmetric": self.input_symmetric,
            "strategy": self.input_strategy,
            "dynamic": dynamic,
        }

    @property
    def strategy(self) -> str:
        """compressed-tensors' ``strategy``: ``channel`` or ``group``."""
        return "channel" if self.group_size is None else "group"

    def weights_args(self) -> dict[str, Any]:
        """The ``weights`` entry of a config group (valid ``QuantizationArgs`` keys only; MX:
        compressed-tensors' own serialization of its ``MXFP8`` / ``MXFP4`` presets)."""
        if self.is_mx:
            return {
                "num_bits": self.num_bits,
                "type": "float",
                "symmetric": True,
                "group_size": MX_GROUP_SIZE,
                "strategy": "group",
                "dynamic": False,
                "scale_dtype": MX_SCALE_DTYPE,
            }
        args: dict[str, Any] = {
            "num_bits": self.num_bits,
            "type": "int" if self.value_type is None else "float",
            "symmetric": self.symmetric,
            "strategy": self.strategy,
        }
        if self.group_size is not None:
            args["group_size"] = self.group_size
        args["dynamic"] = False
        if self.actorder is not None:
            args["actorder"] = self.actorder
        return args

    def __str__(self) -> str:
        if self.is_mx:
            return (
                f"{self.value_type} block {MX_GROUP_SIZE} a {self.value_type} block {MX_GROUP_SIZE}"
            )
        if self.value_type is not None:
            return f"{self.value_type} per_channel sym a {self.value_type} per_token"
        scope = "per_channel" if self.group_size is None else f"per_group({self.group_size})"
        order = f" actorder {self.actorder}" if self.actorder else ""
        act = ""
        if self.input_strategy == "token":
            act = " a8 per_token"
        elif self.input_strategy == "tensor":
            act = f" a8 per_tensor {'sym' if self.input_symmetric else 'asym'}"
        return f"int{self.num_bits} {scope} {'sym' if self.symmetric else 'asym'}{order}{act}"


def build_quantization_config(
    schemes: Mapping[str, WeightScheme], ignore: Iterable[str], head: str | None = None
) -> dict[str, Any]:
    """``config.json``'s ``quantization_config`` for quantized modules ``schemes`` (name -> scheme).

    The most common scheme (ties: the first met) targets the class ``Linear``; every other scheme
    lists its modules by exact name, which wins over a class target in compressed-tensors and vLLM.
    The named groups come first: compressed-tensors scans targets in config order when it applies
    the config, and warns about exact names it never reached behind ``Linear``. For the same reason
    a quantized output head sharing the most common scheme is named before ``Linear``: vLLM and
    SGLang quantize the head only when a target names it.

    :param schemes: quantized module name -> scheme, in model order.
    :param ignore: names of the linear layers (and routers) left unquantized.
    :param head: the quantized output head's name (one of ``schemes``), None when it is float.
    :raises QuantizationError: when ``schemes`` is empty.
    """
    if not schemes:
        raise QuantizationError(
            "compressed_tensors: no linear layer was quantized, so there is nothing to export in "
            "compressed-tensors format; add a linear_quant process entry that selects some layers"
        )
    ranked = [scheme for scheme, _ in Counter(schemes.values()).most_common()]
    targets: dict[WeightScheme, list[str]] = {
        scheme: [name for name, found in schemes.items() if found == scheme]
        for scheme in ranked[1:]
    }
    base = ranked[0]
    targets[base] = [head] if head is not None and schemes.get(head) == base else []
    targets[base].append("Linear")
    groups = {
        f"group_{index}": {
            "targets": names,
            "weights": scheme.weights_args(),
            "input_activations": scheme.input_args(),
            "output_activations": None,
            "format": scheme.format,
        }
        for index, (scheme, names) in enumerate(targets.items())
    }
    formats = {scheme.format for scheme in targets}
    # MX groups: always mixed-precision, so that vLLM-Ascend keeps their input_activations
    single = len(formats) == 1 and not any(scheme.is_mx for scheme in targets)
    return {
        "quant_method": "compressed-tensors",
        "version": COMPRESSED_TENSORS_VERSION,
        "format": formats.pop() if single else MIXED_PRECISION,
        "quantization_status": "compressed",
        "global_compression_ratio": None,
        "kv_cache_scheme": None,
        "sparsity_config": {},
        "ignore": list(ignore),
        "config_groups": groups,
    }
