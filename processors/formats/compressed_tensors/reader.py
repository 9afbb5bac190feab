"""Reader of compressed-tensors checkpoints (``quant_method == "compressed-tensors"``).

The config groups are parsed and checked in
:mod:`~msquant.processors.formats.compressed_tensors.config_groups`.

Two formats are read: the weight-only ``pack-quantized`` one (``shared/reference/formats.md`` 3.2)
and ``int-quantized`` int8 W8A8 (``weight`` int8, ``weight_scale``, and for static activations
``input_scale`` / ``input_zero_point``; see docs/formats.md). Per ``pack-quantized`` linear ``P``:

* ``P.weight_packed`` int32 ``[out, ceil(in*b/32)]``: codes ``q + 2^(b-1)`` packed densely along
  the input dimension, LSB first;
* ``P.weight_scale`` float ``[out, G]`` (G = 1 for ``strategy: channel``, ``in/group_size`` for
  ``group``); ``P.weight_shape`` integer ``[2]`` = ``[out, in]``;
* asymmetric only: ``P.weight_zero_point`` int32 ``[ceil(out*b/32), G]``, zero points
  ``zp + 2^(b-1)`` packed along the output dimension;
* ``w = (q - zp) * scale`` with column ``i`` in group ``i // group_size``.

int8 W8A8 groups (``int-quantized`` with ``input_activations``, vLLM's
``CompressedTensorsW8A8Int8``) are read by :mod:`.int_quantized`: ``P.weight`` int8 ``[out, in]``,
``P.weight_scale`` ``[out, 1]``, static activations' ``P.input_scale`` / ``P.input_zero_point``;
``msquant eval`` simulates their activations (:meth:`CompressedTensorsReader.activation_of`).
FP8 W8A8 groups (``float-quantized``) are read by :mod:`.float_quantized`, MX groups
(``mxfp8-quantized``: ``P.weight`` ``float8_e4m3fn``; ``mxfp4-pack-quantized``: ``P.weight_packed``
uint8 ``[out, in / 2]``; both with uint8 E8M0 ``P.weight_scale`` ``[out, in / 32]``) by
:mod:`.mx_quantized`; ``msquant eval`` quantizes their activations per block of 32.

The config's ``config_groups`` map ``targets`` (exact module names, ``re:`` regexes matched with
``re.match``, or class names such as ``Linear``) to weight schemes; ``ignore`` lists modules kept
in float. For a module, an exact name wins over a regex, which wins over a class name.
"""

from __future__ import annotations

import re
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import torch

from msquant.plugin import ActivationQuant, DecodedLayer, ExportReader, Findings, LayerReport
from msquant.plugin.reading import open_weights, trivial_g_idx, unpack_int32_stream, words_needed
from msquant.processors.formats.compressed_tensors import int_quantized
from msquant.processors.formats.compressed_tensors.config_groups import (
    PACK_QUANTIZED,
    ConfigGroup,
    CTScheme,
    parse_config_groups,
)
from msquant.processors.formats.compressed_tensors.float_quantized import decode_fp8_layer
from msquant.processors.formats.compressed_tensors.int_quantized import INT_PARTS, INT_QUANTIZED
from msquant.processors.formats.compressed_tensors.mx_quantized import MX_PARTS, decode_mx_layer

__all__ = ["CompressedTensorsReader", "CTScheme"]

PARTS = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx")
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INT_DTYPES = (torch.int64, torch.int32)
CLASS_TARGETS = ("Linear",)
EMBEDDING_HINTS = ("embed", "wte", "wpe")

TRANSFORMERS_ASYM = (
    "transformers loads asymmetric pack-quantized weights only with "
    "CompressedTensorsConfig(dequantize=True) (the default loader fails on weight_zero_point)"
)
VLLM_BITS = "vLLM's CompressedTensorsWNA16 loads pack-quantized weights of 2 to 8 bits only"
VLLM_HEAD = (
    "vLLM and SGLang give the output head (a ParallelLMHead) a compressed-tensors scheme only when "
    "a target names it, and only the class target Linear matches it here: a packed head does not "
    "load there (transformers loads it); name it in its group's targets"
)
SGLANG_BITS = "SGLang loads compressed-tensors weight-only layers of 4 or 8 bits only"
DENSE_PACKING = (
    "3/5/6/7-bit weights packed densely across int32 words need compressed-tensors >= 0.18 to "
    "unpack (vLLM 0.33 / 0.34 pin 0.17.0; transformers with 0.17 fails to load them)"
)
HEAD_NAMES = ("lm_head",)
VLLM_MX_WEIGHT_ONLY = (
    "vLLM 0.33 / 0.34 quantize MX activations only on SM100+ GPUs with FlashInfer; below, their "
    "Marlin MXFP8 / MXFP4 kernels (linear and MoE) run these layers weight-only (activations "
    "in float), which msquant eval does not simulate (docs/formats.md, MX)"
)
VLLM_ASYM_ZERO_POINT = (
    "vLLM 0.33 / 0.34's CUTLASS int8 kernel rebuilds a static asymmetric input zero point with a "
    "truncating conversion, which can move it one step toward 0 (docs/formats.md, int8 W8A8)"
)


class CompressedTensorsReader(ExportReader):
    """Checks ``quantization_config`` and every ``weight_packed`` set."""

    format_name = "compressed-tensors"

    def __init__(self, directory: Path, findings: Findings, config: dict[str, Any]) -> None:
        super().__init__(directory, findings)
        self.qconfig: dict[str, Any] = dict(config.get("quantization_config") or {})
        self._check_top_level()
        self.groups = parse_config_groups(self.qconfig, self.findings)
        ignore = self.qconfig.get("ignore") or []
        self.ignore: tuple[str, ...] = (
            tuple(str(i) for i in ignore) if isinstance(ignore, list) else ()
        )
        self.store = open_weights(directory, "model", findings)
        self.int_modules = self._find_int_modules()
        self.modules = sorted({*self._find_modules(), *self.int_modules})
        self.packed = {f"{m}.{part}" for m in self.modules for part in PARTS}
        self.packed |= {f"{m}.{part}" for m in self.int_modules for part in INT_PARTS}
        self._check_float_modules()

    # --- config ----------------------------------------------------------------------------

    def _check_top_level(self) -> None:
        where = "config.json quantization_config"
        status = self.qconfig.get("quantization_status")
        if status != "compressed":
            self.findings.error(
                f"{where}: quantization_status {status!r}, expected 'compressed' for a saved checkpoint"
            )
        if "format" not in self.qconfig:
            self.findings.error(f"{where} lacks 'format' (vLLM and transformers read it)")
        if not isinstance(self.qconfig.get("ignore", []), list):
            self.findings.error(f"{where}: ignore must be a list")

    # --- module matching ------------------------------------------------------------------

    def _matches(self, module: str, target: str, by_class: bool) -> int:
        """Match strength of ``target`` on ``module``: 3 exact, 2 regex, 1 class, 0 none."""
        if target == module:
            return 3
        if target.startswith("re:"):
            try:
                return 2 if re.match(target[3:], module) else 0
            except re.error:
                return 0
        return 1 if by_class and target in CLASS_TARGETS else 0

    def group_of(self, module: str, by_class: bool = True) -> tuple[ConfigGroup | None, int]:
        """The config group targeting ``module`` (strongest match, then file order)."""
        best: tuple[ConfigGroup | None, int] = (None, 0)
        for group in self.groups:
            strength = max((self._matches(module, t, by_class) for t in group.targets), default=0)
            if strength > best[1]:
                best = (group, strength)
        return best

    def ignored(self, module: str, by_class: bool = True) -> bool:
        """Whether ``ignore`` lists ``module`` (exactly, by ``re:`` regex or by class)."""
        return any(self._matches(module, entry, by_class) for entry in self.ignore)

    def _find_modules(self) -> list[str]:
        """The ``pack-quantized`` modules (int8 ``int-quantized`` ones are found apart: they
        share ``weight_scale``)."""
        if self.store is None or not self.int_modules:
            return self.find_packed_modules(PARTS, PARTS[:4], "compressed layer")
        ints = set(self.int_modules)
        packed = [
            name
            for name in self.store.names()
            if name.rpartition(".")[0] not in ints and name.rpartition(".")[2] in PARTS
        ]
        return sorted({name.rpartition(".")[0] for name in packed})

    def _find_int_modules(self) -> list[str]:
        """Modules storing an int8 ``weight`` (``int-quantized``) or a ``float8_e4m3fn`` one
        (``float-quantized``); other tensors under them than
        :data:`INT_PARTS` and ``bias`` are errors."""
        if self.store is None:
            return []
        names = self.store.names()
        modules = sorted(
            name[: -len(".weight")]
            for name in names
            if name.endswith(".weight")
            and self.store.infos[name].dtype in (torch.int8, torch.float8_e4m3fn)
        )
        for module in modules:
            for name in names:
                leaf = name[len(module) + 1 :] if name.startswith(f"{module}.") else None
                if leaf is not None and "." not in leaf and leaf not in (*INT_PARTS, "bias"):
                    self.findings.error(
                        f"{name}: unexpected tensor for int8 layer {module} (expected "
                        f"{', '.join(INT_PARTS)}, bias)"
                    )
        return modules

    def _check_float_modules(self) -> None:
        """Float linears that a target names must be quantized (or listed in ``ignore``)."""
        if self.store is None:
            return
        for name in self.store.names():
            module = name[: -len(".weight")] if name.endswith(".weight") else None
            if module is None or len(self.store.infos[name].shape) != 2 or module in self.modules:
                continue
            group, strength = self.group_of(module)
            if group is None or self.ignored(module):
                continue
            if strength >= 2:
                self.findings.error(
                    f"{name} is stored in float but {group.name} targets {module}, and ignore does "
                    "not list it: loaders expect weight_packed"
                )
            elif not any(hint in module.rpartition(".")[2] for hint in EMBEDDING_HINTS):
                self.findings.warn(
                    f"{name} is stored in float but {group.name} targets class Linear and ignore "
                    f"does not list {module}: if it is a Linear, loaders expect weight_packed"
                )

    # --- layers ----------------------------------------------------------------------------

    def quantized_modules(self) -> list[str]:
        return list(self.modules)

    def scheme_of(self, module: str) -> CTScheme | None:
        """The scheme a loader applies to ``module`` (None when untargeted or ignored)."""
        group, _ = self.group_of(module)
        if group is None or self.ignored(module):
            return None
        return group.scheme

    def entry(self, module: str) -> LayerReport:
        scheme = self.scheme_of(module)
        if scheme is None:
            return LayerReport(module, PACK_QUANTIZED)
        return LayerReport(module, scheme.group, scheme.bits, scheme.group_size, scheme.symmetric)

    def decode(self, module: str) -> DecodedLayer | None:
        group, _ = self.group_of(module)
        if group is None:
            self.findings.error(
                f"{module}.weight_packed is stored but no config_groups target matches {module}"
            )
            return None
        if self.ignored(module):
            self.findings.error(f"{module}.weight_packed is stored but ignore lists {module}")
            return None
        if group.scheme is None or self.store is None:
            return None  # the group's config error is already reported
        scheme = group.scheme
        if scheme.is_mx:
            return self._decode_mx(module, group.name, scheme)
        if (module in self.int_modules) != (scheme.input_strategy is not None):
            stored = "an unpacked weight" if module in self.int_modules else "weight_packed"
            self.findings.error(
                f"{module}: stores {stored} but its group {group.name} is {scheme.describe()} "
                f"({INT_QUANTIZED} layers store int8 weight, {PACK_QUANTIZED} weight_packed)"
            )
            return None
        if scheme.value_type is not None:
            return decode_fp8_layer(module, group.name, self._int_tensors(module), self.findings)
        if scheme.input_strategy is not None:
            return int_quantized.decode_int_layer(
                module,
                group.name,
                scheme.input_strategy,
                scheme.input_symmetric,
                self._int_tensors(module),
                self.findings,
            )
        names = {part: f"{module}.{part}" for part in PARTS}
        if names["weight_g_idx"] in self.store:
            self.findings.error(
                f"{names['weight_g_idx']}: weight_g_idx no longer exists in compressed-tensors"
            )
        if scheme.symmetric and names["weight_zero_point"] in self.store:
            self.findings.error(
                f"{names['weight_zero_point']}: stored for a symmetric scheme ({scheme.group}), "
                "which has no zero point"
            )
        present = [
            self.expect(names["weight_packed"], (torch.int32,), None),
            self.expect(names["weight_shape"], INT_DTYPES, (2,)),
            self.expect(names["weight_scale"], FLOAT_DTYPES, None),
        ]
        if not all(present):
            return None
        return self._decode_checked(module, scheme, names)

    def _decode_checked(
        self, module: str, scheme: CTScheme, names: dict[str, str]
    ) -> DecodedLayer | None:
        assert self.store is not None
        out_features, in_features = (int(v) for v in self.store.get(names["weight_shape"]).tolist())
        bits = scheme.bits
        packed = (out_features, words_needed(in_features, bits))
        where = f" ({scheme.describe()}, weight_shape [{out_features}, {in_features}])"
        if not self.expect(names["weight_packed"], (torch.int32,), packed, where):
            return None
        width = in_features if scheme.group_size is None else scheme.group_size
        groups = -(-in_features // width)
        if not self.expect(names["weight_scale"], FLOAT_DTYPES, (out_features, groups), where):
            return None
        codes, clean = unpack_int32_stream(
            self.store.get(names["weight_packed"]), bits, in_features, 1
        )
        if not clean:
            self.findings.error(
                f"{names['weight_packed']}: padding bits after the last code are not zero"
            )
        half = 2 ** (bits - 1)
        offset = torch.zeros(out_features, groups, dtype=torch.float32)
        if not scheme.symmetric:
            zero_shape = (words_needed(out_features, bits), groups)
            if not self.expect(names["weight_zero_point"], (torch.int32,), zero_shape, where):
                return None
            zeros, clean = unpack_int32_stream(
                self.store.get(names["weight_zero_point"]), bits, out_features, 0
            )
            if not clean:
                self.findings.error(
                    f"{names['weight_zero_point']}: padding bits after the last zero point are not zero"
                )
            offset = (zeros - half).to(torch.float32)
        scale = self.store.get(names["weight_scale"])
        return DecodedLayer(
            name=module,
            scheme=scheme.group,
            bits=bits,
            group_size=scheme.group_size,
            codes=(codes - half).to(torch.int32),
            scale=scale.to(torch.float32),
            offset=offset,
            g_idx=trivial_g_idx(in_features, width),
            scale_dtype=scale.dtype,
            tensors={
                "codes": names["weight_packed"],
                "scale": names["weight_scale"],
                "offset": names["weight_zero_point"],
                "g_idx": f"{module} (implicit groups)",
            },
        )

    def _decode_mx(self, module: str, group: str, scheme: CTScheme) -> DecodedLayer | None:
        """An MX layer: its :data:`MX_PARTS` decoded, any other quantization tensor refused."""
        assert self.store is not None and scheme.value_type is not None
        extra = [
            f"{module}.{part}"
            for part in (*PARTS, *INT_PARTS)
            if part not in MX_PARTS and f"{module}.{part}" in self.store
        ]
        if extra:
            self.findings.error(
                f"{', '.join(sorted(set(extra)))}: not part of an MX layer ({scheme.describe()}: "
                f"{', '.join(MX_PARTS[1:] if scheme.value_type == 'mxfp4' else MX_PARTS[::2])})"
            )
            return None
        tensors = {
            part: self.store.get(f"{module}.{part}")
            for part in MX_PARTS
            if f"{module}.{part}" in self.store
        }
        return decode_mx_layer(module, group, scheme.value_type, tensors, self.findings)

    def _int_tensors(self, module: str) -> dict[str, torch.Tensor]:
        assert self.store is not None
        return {
            part: self.store.get(f"{module}.{part}")
            for part in INT_PARTS
            if f"{module}.{part}" in self.store
        }

    def activation_of(self, module: str) -> ActivationQuant | None:
        """How the deployed layer ``module`` quantizes its input (``msquant eval`` simulates
        it): per-token, or the stored static ``input_scale`` / ``input_zero_point``; None for
        weight-only layers. Call after :meth:`decode` checked the layer."""
        scheme = self.scheme_of(module)
        if scheme is not None and scheme.is_mx:  # dynamic, per block of 32, the weights' type
            return ActivationQuant("per_block", value_type=scheme.value_type)
        if scheme is None or scheme.input_strategy is None or module not in self.int_modules:
            return None
        if scheme.value_type is not None:  # FP8: dynamic per token
            return ActivationQuant("per_token", value_type=scheme.value_type)
        return int_quantized.activation_of(
            scheme.input_strategy, scheme.input_symmetric, self._int_tensors(module)
        )

    def consumer_notes(self, layer: DecodedLayer) -> None:
        scheme = self.scheme_of(layer.name)
        if scheme is not None and scheme.is_mx:
            self.findings.note(VLLM_MX_WEIGHT_ONLY, layer.name)
            return
        if scheme is not None and scheme.input_strategy == "tensor" and not scheme.input_symmetric:
            self.findings.note(VLLM_ASYM_ZERO_POINT, layer.name)
        if scheme is None or scheme.input_strategy is not None:
            return
        if not scheme.symmetric:
            self.findings.note(TRANSFORMERS_ASYM, layer.name)
        if scheme.bits < 2:
            self.findings.note(VLLM_BITS, layer.name)
        if scheme.bits not in (4, 8):
            self.findings.note(SGLANG_BITS, layer.name)
        if scheme.bits in (3, 5, 6, 7):
            self.findings.note(DENSE_PACKING, layer.name)
        if layer.name.rpartition(".")[2] in HEAD_NAMES and self.group_of(layer.name)[1] < 2:
            self.findings.note(VLLM_HEAD, layer.name)

    def schemes(self) -> tuple[dict[str, Hashable], dict[str, str]]:
        """The fused-layer check's view; static int8 layers add their input scale and zero
        point, which vLLM loads once per fused layer (q/k/v, gate/up)."""
        schemes, describe = self.hf_schemes(self.modules, self.scheme_of)
        for module in self.int_modules:
            scheme = self.scheme_of(module)
            if scheme is None or scheme.input_strategy is None:
                continue
            shared = int_quantized.fused_key(scheme.input_strategy, self._int_tensors(module))
            if shared is not None:
                schemes[module] = (schemes[module], shared)
                describe[module] += f" input_scale {shared[0]:.6g} zero_point {shared[1]:g}"
        return schemes, describe
