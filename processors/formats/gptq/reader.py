"""Reader of GPTQ checkpoints (``quantization_config.quant_method == "gptq"``).

Layout (``shared/reference/formats.md`` 3.1), per quantized linear ``P``:

* ``P.qweight`` int32 ``[in*bits/32, out]``: unsigned codes packed along the input dimension,
  LSB first (3-bit values straddle words);
* ``P.qzeros`` int32 ``[G, out*bits/32]``: unsigned zero points packed along the output
  dimension; format ``gptq`` (v1) stores ``zero - 1``, ``gptq_v2`` stores ``zero``;
* ``P.scales`` float ``[G, out]``; ``P.g_idx`` int32 ``[in]``, the group of every input column;
* ``w[o, i] = scales[g_idx[i], o] * (q[i, o] - zero[g_idx[i], o])``.

``quantization_config`` must carry ``bits, group_size, desc_act, sym`` (vLLM raises without them);
``dynamic`` holds per-module overrides (``-:`` excludes a module, first match wins, ``re.match``
on the full module name); vLLM matches it against fused names (``qkv_proj``) and, for MoE, against
the experts module's name (``model.layers.N.mlp.experts``) only, so both must resolve as stored.
``modules_in_block_to_quantize`` (optional, a list of lists of names) selects the quantized
linears for transformers + optimum (a name ending with an entry) and vLLM (an entry inside the
name).

The checks of the loaders' rules on the checkpoint as a whole (``dynamic`` against fused and MoE
experts names, ``modules_in_block_to_quantize``, what transformers mis-loads) are in
:mod:`~msquant.processors.formats.gptq.loader_rules`; this module decodes and checks each layer.
"""

from __future__ import annotations

import re
from collections.abc import Hashable
from pathlib import Path
from typing import Any, NamedTuple, TypeGuard

import torch

from msquant.plugin import DecodedLayer, ExportReader, Findings, LayerReport
from msquant.plugin.reading import (
    open_weights,
    read_json,
    trivial_g_idx,
    unpack_int32_stream,
    words_needed,
)
from msquant.processors.formats.gptq.loader_rules import check_loader_rules

__all__ = ["GPTQReader", "GPTQStoredScheme"]

PARTS = ("qweight", "qzeros", "scales", "g_idx")
SUPPORTED_BITS = (2, 3, 4, 8)
REQUIRED_KEYS = ("bits", "group_size", "desc_act", "sym")
OVERRIDABLE = ("bits", "group_size", "desc_act", "sym")  # what vLLM applies from `dynamic`
COMPARED_KEYS = ("bits", "group_size", "desc_act", "sym", "lm_head", "dynamic", "checkpoint_format")
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MARLIN_GROUPS = (-1, 32, 64, 128)

VLLM_ASYM = (
    "vLLM 0.33 / 0.34 / SGLang load GPTQ only as 4/8-bit symmetric (Marlin): asymmetric layers are "
    "refused; export compressed-tensors for vLLM"
)
VLLM_BITS = (
    "vLLM 0.33 / 0.34 / SGLang load GPTQ only as 4 or 8 bits: other widths are refused; export "
    "compressed-tensors for vLLM"
)
VLLM_DESC_ACT = "vLLM 0.33 / 0.34 refuses desc_act=true with group_size != -1 (group activation ordering was removed)"
DESC_ACT_TRIVIAL = (
    "g_idx is trivial but desc_act is true: write desc_act false "
    "(vLLM 0.33 / 0.34 refuses desc_act=true)"
)
MARLIN_GROUP_NOTE = (
    "Marlin GPTQ kernels take group_size -1, 32, 64 or 128 only: vLLM 0.33 / 0.34 refuses these layers "
    "and SGLang has no other CUDA GPTQ kernel"
)
MARLIN_SHAPE_NOTE = (
    "not whole Marlin tiles (out_features % 64, in_features % 128, fused q/k/v and gate/up "
    "counted whole, at tensor-parallel size 1): vLLM 0.33 / 0.34 zero-pads them and loads them; SGLang "
    "0.5.23 runs Marlin on them unchecked, so do not serve this with SGLang"
)


class GPTQStoredScheme(NamedTuple):
    """The scheme one module is stored in, as a loader reads it: the base ``quantization_config``
    after ``dynamic`` overrides, ``desc_act`` included (the writer's scheme is
    :class:`msquant.processors.formats.gptq.scheme.GPTQScheme`)."""

    bits: int
    group_size: int
    sym: bool
    desc_act: bool

    def key(self) -> Hashable:
        """The comparable form of the scheme (the tuple itself)."""
        return tuple(self)

    def describe(self) -> str:
        """E.g. ``int4 group 32 sym``."""
        group = "per-channel" if self.group_size == -1 else f"group {self.group_size}"
        text = f"int{self.bits} {group} {'sym' if self.sym else 'asym'}"
        return text + (" desc_act" if self.desc_act else "")


class GPTQReader(ExportReader):
    """Checks ``quantization_config`` and every ``qweight``/``qzeros``/``scales``/``g_idx`` set."""

    format_name = "gptq"

    def __init__(self, directory: Path, findings: Findings, config: dict[str, Any]) -> None:
        super().__init__(directory, findings)
        self.qconfig: dict[str, Any] = dict(config.get("quantization_config") or {})
        self._overridden: dict[str, GPTQStoredScheme | None] = {}
        self.base = self._base_scheme()
        self.v2 = self._checkpoint_version()
        self.dynamic = self._dynamic_rules()
        self.store = open_weights(directory, "model", findings)
        self.modules = self._find_modules()
        self.packed = {f"{m}.{part}" for m in self.modules for part in PARTS}
        self._check_quantize_config_json()
        self._check_lm_head()

    # --- config ----------------------------------------------------------------------------

    def _base_scheme(self) -> GPTQStoredScheme | None:
        missing = [key for key in REQUIRED_KEYS if key not in self.qconfig]
        for key in missing:
            self.findings.error(
                f"config.json quantization_config lacks {key!r} (vLLM requires bits, group_size, "
                "desc_act and sym)"
            )
        if missing:
            return None
        return self._scheme(self.qconfig, "config.json quantization_config")

    def _scheme(self, values: dict[str, Any], where: str) -> GPTQStoredScheme | None:
        bits, group_size = values.get("bits"), values.get("group_size")
        sym, desc_act = values.get("sym"), values.get("desc_act")
        ok = True
        if not _is_int(bits) or bits not in SUPPORTED_BITS:
            self.findings.error(
                f"{where}: bits {bits!r} is not readable GPTQ (2, 3, 4 or 8; 5-7 bits use the "
                "planar gptq_p format)"
            )
            ok = False
        if not _is_int(group_size) or (group_size != -1 and group_size <= 0):
            self.findings.error(f"{where}: group_size {group_size!r} must be -1 or positive")
            ok = False
        for key, value in (("sym", sym), ("desc_act", desc_act)):
            if not isinstance(value, bool):
                self.findings.error(f"{where}: {key} {value!r} must be true or false")
                ok = False
        if ok and _is_int(bits) and _is_int(group_size):
            return GPTQStoredScheme(bits, group_size, bool(sym), bool(desc_act))
        return None

    def _checkpoint_version(self) -> bool:
        """True for ``gptq_v2`` (zero points stored as is), False for v1 (``zero - 1``)."""
        names = {
            key: self.qconfig[key] for key in ("checkpoint_format", "format") if key in self.qconfig
        }
        values = set(names.values())
        if len(values) > 1:
            self.findings.error(f"config.json quantization_config: format values disagree {names}")
        for value in values:
            if value not in ("gptq", "gptq_v2"):
                self.findings.error(
                    f"config.json quantization_config: format {value!r} is not readable by msquant "
                    "verify (gptq or gptq_v2)"
                )
        pack_dtype = self.qconfig.get("pack_dtype", "int32")
        if pack_dtype != "int32":
            self.findings.error(
                f"config.json quantization_config: pack_dtype {pack_dtype!r}, expected int32"
            )
        return "gptq_v2" in values

    def _dynamic_rules(self) -> list[tuple[str, bool, re.Pattern[str], dict[str, Any]]]:
        """``(pattern, negative, compiled, overrides)`` in file order."""
        dynamic = self.qconfig.get("dynamic") or {}
        if not isinstance(dynamic, dict):
            self.findings.error("config.json quantization_config: dynamic must be an object")
            return []
        rules = []
        seen_positive = False
        for pattern, overrides in dynamic.items():
            negative = pattern.startswith("-:")
            raw = pattern[2:] if pattern.startswith(("-:", "+:")) else pattern
            try:
                compiled = re.compile(raw)
            except re.error as exc:
                self.findings.error(f"quantization_config.dynamic: bad pattern {pattern!r} ({exc})")
                continue
            if not isinstance(overrides, dict):
                self.findings.error(f"quantization_config.dynamic[{pattern!r}] must be an object")
                continue
            if negative and seen_positive:
                self.findings.warn(
                    f"quantization_config.dynamic: negative rule {pattern!r} follows a positive one; "
                    "GPTQModel moves negative rules first while vLLM keeps the file order"
                )
            seen_positive = seen_positive or not negative
            rules.append((pattern, negative, compiled, overrides))
        return rules

    def resolve(self, module: str) -> GPTQStoredScheme | None:
        """The scheme vLLM / GPTQModel give ``module`` (first matching ``dynamic`` rule wins);
        None when a negative rule excludes it or the config is unusable."""
        if self.base is None:
            return None
        for pattern, negative, compiled, overrides in self.dynamic:
            if compiled.match(module):
                if negative:
                    return None
                return self._override(pattern, overrides)
        return self.base

    def _override(self, pattern: str, overrides: dict[str, Any]) -> GPTQStoredScheme | None:
        """The base scheme with one positive rule's overrides (validated once per rule)."""
        if pattern not in self._overridden:
            assert self.base is not None
            merged = self.base._asdict()
            merged.update({k: v for k, v in overrides.items() if k in OVERRIDABLE})
            where = f"quantization_config.dynamic[{pattern!r}]"
            self._overridden[pattern] = self._scheme(merged, where)
        return self._overridden[pattern]

    def _check_quantize_config_json(self) -> None:
        path = self.directory / "quantize_config.json"
        other = read_json(path, self.findings, required=False)
        if other is None:
            if not path.exists():
                self.findings.warn(
                    "quantize_config.json is missing: GPTQModel / AutoGPTQ-style loaders read it"
                )
            return
        for key in COMPARED_KEYS:
            if key in other and key in self.qconfig and other[key] != self.qconfig[key]:
                self.findings.error(
                    f"quantize_config.json {key}={other[key]!r} differs from config.json "
                    f"quantization_config {key}={self.qconfig[key]!r}"
                )

    def _find_modules(self) -> list[str]:
        return self.find_packed_modules(PARTS, PARTS, "GPTQ layer")

    def _check_lm_head(self) -> None:
        quantized_head = "lm_head" in self.modules
        flag = bool(self.qconfig.get("lm_head", False))
        if quantized_head and not flag:
            self.findings.error(
                "lm_head.qweight is stored but quantization_config.lm_head is false: loaders "
                "expect lm_head.weight"
            )
        if flag and not quantized_head and self.store is not None:
            self.findings.error(
                "quantization_config.lm_head is true but lm_head.qweight is not stored"
            )

    # --- layers ----------------------------------------------------------------------------

    def quantized_modules(self) -> list[str]:
        return list(self.modules)

    def entry(self, module: str) -> LayerReport:
        scheme = self.resolve(module)
        if scheme is None:
            return LayerReport(module, "gptq")
        group = None if scheme.group_size == -1 else scheme.group_size
        return LayerReport(module, "gptq_v2" if self.v2 else "gptq", scheme.bits, group, scheme.sym)

    def decode(self, module: str) -> DecodedLayer | None:
        scheme = self.resolve(module)
        if scheme is None:
            if self.base is not None:
                self.findings.error(
                    f"{module}.qweight is stored but quantization_config.dynamic excludes {module} "
                    "(loaders expect a float weight)"
                )
            return None
        names = {part: f"{module}.{part}" for part in PARTS}
        dtypes = {"qweight": (torch.int32,), "qzeros": (torch.int32,), "scales": FLOAT_DTYPES}
        dtypes["g_idx"] = (torch.int32,)
        present = [self.expect(names[part], dtypes[part], None) for part in PARTS]
        if not all(present) or self.store is None:
            return None
        return self._decode_checked(module, scheme, names)

    def _decode_checked(
        self, module: str, scheme: GPTQStoredScheme, names: dict[str, str]
    ) -> DecodedLayer | None:
        assert self.store is not None
        bits = scheme.bits
        qweight_shape = self.store.infos[names["qweight"]].shape
        g_idx_shape = self.store.infos[names["g_idx"]].shape
        if len(qweight_shape) != 2 or len(g_idx_shape) != 1:
            self.findings.error(
                f"{names['qweight']} {list(qweight_shape)} / {names['g_idx']} {list(g_idx_shape)}: "
                "expected a 2-D qweight and a 1-D g_idx"
            )
            return None
        in_features, out_features = g_idx_shape[0], qweight_shape[1]
        rows = words_needed(in_features, bits)
        if qweight_shape[0] != rows:
            self.findings.error(
                f"{names['qweight']}: shape {list(qweight_shape)}, expected [{rows}, {out_features}] "
                f"for in_features {in_features} (len of g_idx) at {bits} bits packed along dim 0 "
                "(transposed or packed along the wrong dimension?)"
            )
            return None
        width = in_features if scheme.group_size == -1 else scheme.group_size
        groups = -(-in_features // width)
        ok = self.expect(
            names["scales"], FLOAT_DTYPES, (groups, out_features), f" ({scheme.describe()})"
        )
        zeros_shape = (groups, words_needed(out_features, bits))
        ok = (
            self.expect(names["qzeros"], (torch.int32,), zeros_shape, f" ({scheme.describe()})")
            and ok
        )
        if not ok:
            return None
        codes, clean = unpack_int32_stream(self.store.get(names["qweight"]), bits, in_features, 0)
        if not clean:
            self.findings.error(
                f"{names['qweight']}: padding bits after the last code are not zero"
            )
        zeros, clean = unpack_int32_stream(self.store.get(names["qzeros"]), bits, out_features, 1)
        if not clean:
            self.findings.error(
                f"{names['qzeros']}: padding bits after the last zero point are not zero"
            )
        zeros = self._check_zeros(names["qzeros"], zeros, scheme)
        scales = self.store.get(names["scales"])
        half = 2 ** (bits - 1)
        g_idx = self.store.get(names["g_idx"]).to(torch.int64)
        self._check_g_idx(names["g_idx"], g_idx, width, scheme)
        return DecodedLayer(
            name=module,
            scheme="gptq_v2" if self.v2 else "gptq",
            bits=bits,
            group_size=None if scheme.group_size == -1 else scheme.group_size,
            codes=(codes - half).t().to(torch.int32).contiguous(),
            scale=scales.to(torch.float32).t().contiguous(),
            offset=(zeros - half).to(torch.float32).t().contiguous(),
            g_idx=g_idx,
            scale_dtype=scales.dtype,
            tensors={
                "codes": names["qweight"],
                "scale": names["scales"],
                "offset": names["qzeros"],
                "g_idx": names["g_idx"],
            },
        )

    def _check_zeros(
        self, name: str, fields: torch.Tensor, scheme: GPTQStoredScheme
    ) -> torch.Tensor:
        """Zero points from the stored fields (v1: ``field + 1``), checked; returns them."""
        limit = 2**scheme.bits
        if self.v2:
            zeros = fields
        else:
            wrapped = fields == limit - 1
            if bool(wrapped.any()):
                # (0 - 1) mod 2^b: a safe decoder reads zero 0, but kernels that add 0x11111111 to
                # whole words (GPTQModel, transformers + optimum) carry into the next field.
                self.findings.error(
                    f"{name}: {int(wrapped.sum())} zero point(s) of 0 stored as {limit - 1}: v1 "
                    "'gptq' stores zero-1, and GPTQModel's word-wise +1 carries into the next "
                    "column's zero point; write checkpoint_format gptq_v2"
                )
            zeros = (fields + 1) % limit
        if scheme.sym and bool((zeros != limit // 2).any()):
            self.findings.error(
                f"{name}: sym is true but {int((zeros != limit // 2).sum())} zero point(s) differ "
                f"from {limit // 2} (vLLM ignores qzeros of symmetric checkpoints, transformers "
                "and GPTQModel use them)"
            )
        return zeros

    def _check_g_idx(
        self, name: str, g_idx: torch.Tensor, width: int, scheme: GPTQStoredScheme
    ) -> None:
        trivial = torch.equal(g_idx, trivial_g_idx(g_idx.numel(), width))
        if not trivial and not scheme.desc_act:
            self.findings.error(
                f"{name}: non-trivial group order with desc_act false (loaders that trust "
                "desc_act=false, like vLLM, drop g_idx and mis-dequantize)"
            )
        if trivial and scheme.desc_act:
            self.findings.note(DESC_ACT_TRIVIAL, name.removesuffix(".g_idx"))

    def consumer_notes(self, layer: DecodedLayer) -> None:
        scheme = self.resolve(layer.name)
        if scheme is None:
            return
        if not scheme.sym:
            self.findings.note(VLLM_ASYM, layer.name)
        if scheme.bits not in (4, 8):
            self.findings.note(VLLM_BITS, layer.name)
        if scheme.desc_act and scheme.group_size != -1:
            self.findings.note(VLLM_DESC_ACT, layer.name)
        out_features, in_features = layer.shape
        if self.adapter.expert_linear(layer.name) is not None:
            return  # vLLM picks MoE kernels per experts module (Marlin MoE or MoE WNA16)
        if scheme.group_size not in MARLIN_GROUPS:
            self.findings.note(MARLIN_GROUP_NOTE, layer.name)
        elif self._engine_out_features(layer.name, out_features) % 64 or in_features % 128:
            self.findings.note(MARLIN_SHAPE_NOTE, layer.name)

    def _engine_out_features(self, name: str, out_features: int) -> int:
        """The output width of the Marlin layer vLLM and SGLang build for ``name`` at
        tensor-parallel size 1: the whole fused layer's for a q/k/v or gate/up shard."""
        for group in self.adapter.fused_groups(self.modules):
            if name in group.members and self.store is not None:
                return sum(self.store.infos[f"{m}.qweight"].shape[1] for m in group.members)
        return out_features

    def finish(self) -> None:
        check_loader_rules(self)

    def stored_scheme(self, module: str) -> GPTQStoredScheme | None:
        """The scheme ``module`` is stored in: its resolved scheme when its GPTQ tensors are
        stored, None (float) otherwise."""
        return self.resolve(module) if module in self.modules else None

    def linear_names(self) -> list[str]:
        """Every linear layer stored: the quantized modules and every 2-D float ``.weight``."""
        if self.store is None:
            return list(self.modules)
        floats = [
            name[: -len(".weight")]
            for name in self.store.names()
            if name.endswith(".weight") and len(self.store.infos[name].shape) == 2
        ]
        return sorted({*self.modules, *floats})

    def schemes(self) -> tuple[dict[str, Hashable], dict[str, str]]:
        return self.hf_schemes(self.modules, self.resolve)


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)
