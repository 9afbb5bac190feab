"""Reader of the Ascend exports: msModelSlim v1 (``ascendv1_saver``) and MindIE naming.

The activation-quantized types (W8A8, W4A8_DYNAMIC) are decoded in
:mod:`~msquant.processors.formats.ascend.activation_decode`, the type table lives in
:mod:`~msquant.processors.formats.ascend.layer_types`.

Layouts (msModelSlim 26.1, see ``shared/reference/msmodelslim.md`` section 7):

* v1: ``quant_model_description.json`` + ``quant_model_weights.safetensors`` or
  ``quant_model_weights-0000i-of-0000N.safetensors`` + ``quant_model_weights.safetensors.index.json``;
* MindIE: ``quant_model_description[_<type>].json`` + ``quant_model_weight[_<type>].safetensors``.

The description maps every tensor to a type (``W8A16``, ``W4A16``, ``FLOAT``) plus the globals
``version, model_quant_type, metadata, group_size, optional``; keys without a dot are further
globals (msModelSlim's ``ext.json_append`` merges user keys in) and are not tensor entries. Per quantized linear ``P``:

* W8A16: ``P.weight`` int8 ``[out, in]``;
* W4A16: ``P.weight`` int8 ``[out, in/2]``, two signed int4 codes per byte along the input
  dimension (column ``2i`` in the low nibble, ``2i+1`` in the high nibble);
* ``P.weight_scale`` and ``P.weight_offset`` float32 ``[out, 1]`` (per-channel) or
  ``[out, in/group_size]``; ``w = (weight - weight_offset) * weight_scale``; ``P.bias`` FLOAT.
* W8A8_DYNAMIC (per-token activations): as W8A16 per-channel (offset 0);
* W8A8 (static activations): ``P.weight`` int8 ``[out, in]``, ``P.input_scale`` /
  ``P.input_offset`` float32 ``[1]``, ``P.deq_scale`` ``[out]`` (float32 for bf16 models, else
  int64 holding float32 bits; ``= input_scale * weight_scale``, so the weight scale read back is
  ``deq_scale / input_scale``), ``P.quant_bias`` int32 ``[out]`` (``-input_offset * sum_j
  weight[i, j]``, checked exactly).
* C8 (int8 KV cache): ``<attention>.k_proj.kv_cache_scale`` / ``kv_cache_offset`` and the
  ``v_proj`` ones, one value per output feature in the model's dtype, offset 0, typed ``C8``,
  with the globals ``kv_cache_type`` / ``kv_quant_type`` ``C8``;
* W4A8_DYNAMIC: ``P.weight`` int8 ``[out / 2, in]`` (int4 codes in pairs of rows: row ``2i`` in
  the low nibble), ``P.weight_scale`` / ``P.weight_offset`` float32 ``[out, 1]``, ``P.scale_bias``
  float32 ``[out, 1]`` or ``[out, 16]`` (row-parallel layers), checked exactly against the codes.
* MX (W8A8_MXFP8, W4A4_MXFP4, W4A8_MXFP): ``P.weight`` float8_e4m3fn ``[out, in]`` or uint8
  ``[out, in / 2]`` (packed e2m1), ``P.weight_scale`` uint8 E8M0 ``[out, in / 32]``
  (:mod:`~msquant.processors.formats.ascend.mx`).
"""

from __future__ import annotations

import re
from collections.abc import Hashable
from pathlib import Path

import torch

from msquant.plugin import ActivationQuant, DecodedLayer, ExportReader, Findings, LayerReport
from msquant.plugin.model import parse_expert_linear
from msquant.plugin.reading import (
    open_weights,
    read_json,
    ties_word_embeddings,
    trivial_g_idx,
    unpack_int4_pairs,
    weight_files_present,
)
from msquant.processors.formats.ascend.activation_decode import decode_w4a8, decode_w8a8
from msquant.processors.formats.ascend.config import (
    KV_CACHE_GLOBALS,
    KV_CACHE_TYPE,
    model_quant_type,
)
from msquant.processors.formats.ascend.detect import (
    DESCRIPTION_STEM,
    MINDIE_WEIGHTS,
    V1_WEIGHTS,
    description_files,
)
from msquant.processors.formats.ascend.fa_quant import FA_QUANT, fa_quant_problems
from msquant.processors.formats.ascend.fp8 import FP8_PARTS, FP8_TYPE, FP8_VALUES, decode_fp8
from msquant.processors.formats.ascend.layer_types import (
    FLOAT,
    GLOBAL_KEYS,
    PARAMETER_LEAVES,
    PARTS,
    TYPE_BITS,
    TYPE_PARTS,
    W16A16S,
)
from msquant.processors.formats.ascend.mx import (
    MX_PARTS,
    MX_TYPES,
    decode_mx,
    mx_dtypes,
    stored_columns,
)

__all__ = ["AscendReader", "GLOBAL_KEYS", "TYPE_BITS"]

DESCRIPTION_NAME = re.compile(rf"^{DESCRIPTION_STEM}(?:_([A-Za-z0-9_]+))?\.json$")

VLLM_ASCEND_PER_GROUP = (
    "vLLM-Ascend: its W8A16 linear scheme is per-channel only (weight_scale [out, 1]); "
    "per-group W8A16 layers do not load there"
)
VLLM_ASCEND_W4A16 = (
    "vLLM-Ascend has no W4A16 linear scheme (W4A16 is MoE-only there, vllm-ascend#6481); "
    "these layers do not load there"
)
VLLM_ASCEND_ASYM = (
    "vLLM-Ascend passes weight_offset unchanged to npu_weight_quant_batchmatmul, documented as "
    "(weight + offset) * scale, while this format means (weight - offset) * scale: asymmetric "
    "layers may dequantize with the offset's sign flipped (unverified on hardware)"
)

VLLM_ASCEND_W4A8_LINEAR = (
    "vLLM-Ascend serves W4A8_DYNAMIC for MoE experts only (no W4A8_DYNAMIC linear scheme): "
    "these dense layers do not load there; msModelSlim's W4A8 practices quantize attention and "
    "dense MLPs W8A8_DYNAMIC"
)

QUANTIZED_HEAD = (
    "a quantized output head, which msModelSlim never writes: vLLM-Ascend loads it through the "
    "linear scheme of its type (read in its source, not verified on hardware); MindIE support "
    "is unknown"
)
HEAD_NAMES = ("lm_head",)
#: The int8 KV cache's tensors, stored under ``<attention>.k_proj`` and ``<attention>.v_proj``.
KV_CACHE_LEAVES = ("kv_cache_scale", "kv_cache_offset")


class AscendReader(ExportReader):
    """Checks the description, the tensor inventory and each quantized layer of an Ascend export."""

    def __init__(self, directory: Path, findings: Findings) -> None:
        super().__init__(directory, findings)
        self.description_path, self.type_suffix = self._pick_description()
        stem = self._weights_stem()
        self.format_name = "ascend" if stem == V1_WEIGHTS else "mindie"
        self.config = read_json(directory / "config.json", findings, required=False)
        self.store = open_weights(directory, stem, findings)
        description = read_json(self.description_path, findings) or {}
        self.description = description
        self.types: dict[str, str] = {}
        for key, value in description.items():
            if key in GLOBAL_KEYS or "." not in key:
                continue  # globals, and extra keys merged in by msModelSlim's ext.json_append
            if key.endswith(".quant_type"):
                continue  # an attention point's FA3 scheme (fa_quant.py), no tensor
            if isinstance(value, str):
                self.types[key] = value
            else:
                findings.error(
                    f"{self.description_path.name}: {key} has a non-string type {value!r}"
                )
        self.modules = self._quantized_from_description()
        self.packed = {
            f"{m}.{part}" for m in self.modules for part in TYPE_PARTS[self.types[f"{m}.weight"]]
        }
        self._check_inventory()
        self._check_globals()
        self._check_fa_quant()
        self._check_config_json()

    # --- files -----------------------------------------------------------------------------

    def _pick_description(self) -> tuple[Path, str]:
        files = description_files(self.directory)
        if len(files) > 1:
            self.findings.error(
                f"several description files {[p.name for p in files]}: a consumer reads one, "
                "so the export is ambiguous"
            )
        preferred = [p for p in files if p.name == f"{DESCRIPTION_STEM}.json"]
        path = (preferred or files)[0]
        match = DESCRIPTION_NAME.match(path.name)
        suffix = match.group(1) if match and match.group(1) else ""
        if suffix:
            self.findings.warn(
                f"vLLM-Ascend reads {DESCRIPTION_STEM}.json only: rename {path.name} (and its "
                "weights) to serve this MindIE-named export with vLLM-Ascend (vllm-ascend#1270)"
            )
        return path, suffix

    def _weights_stem(self) -> str:
        if self.type_suffix:
            return f"{MINDIE_WEIGHTS}_{self.type_suffix}"
        for stem in (V1_WEIGHTS, MINDIE_WEIGHTS):
            if weight_files_present(self.directory, stem):
                return stem
        return V1_WEIGHTS

    def _check_config_json(self) -> None:
        if self.config is None:
            self.findings.warn(
                "config.json is missing: vLLM-Ascend and MindIE need the model config beside the weights"
            )
            return
        quantization = self.config.get("quantization_config")
        if isinstance(quantization, dict):
            method = quantization.get("quant_method")
            self.findings.warn(
                f"config.json keeps a quantization_config (quant_method {method!r}): vLLM-Ascend "
                "then does not pick the ascend method by itself; msModelSlim removes it"
            )

    # --- description ---------------------------------------------------------------------

    def _quantized_from_description(self) -> list[str]:
        modules = []
        for key, kind in self.types.items():
            if not key.endswith(".weight") or kind in (FLOAT, W16A16S):
                continue  # W16A16S: a pruned float weight (_check_sparse)
            if kind in TYPE_BITS:
                modules.append(key[: -len(".weight")])
            else:
                self.findings.error(
                    f"{key}: quant type {kind} is not supported by msquant verify "
                    f"(it reads {', '.join(TYPE_BITS)}, {W16A16S} and FLOAT)"
                )
        return sorted(modules)

    def _check_inventory(self) -> None:
        """Description vs stored tensors, and which tensors may carry which type."""
        name = self.description_path.name
        stored = set(self.store.infos) if self.store is not None else set()
        tied = ties_word_embeddings(self.config)
        for key in sorted(set(self.types) - stored):
            if self.store is None:
                break
            if tied and key.endswith("lm_head.weight") and self.types[key] == FLOAT:
                continue  # tied heads are stored once (as the embeddings) but still described
            self.findings.error(
                f"{name} types {key} ({self.types[key]}) but no such tensor is stored"
            )
        for key in sorted(stored - set(self.types)):
            self.findings.error(f"{key} is stored but missing from {name}")
        modules = set(self.modules)
        for module in self.modules:
            kind = self.types[f"{module}.weight"]
            for part in TYPE_PARTS[kind][1:]:
                tensor = f"{module}.{part}"
                if tensor in self.types and self.types[tensor] != kind:
                    self.findings.error(
                        f"{name} types {tensor} as {self.types[tensor]} but {module}.weight as {kind}"
                    )
                elif tensor not in self.types and tensor not in stored:
                    self.findings.error(f"{tensor} is missing (layer {module} is {kind})")
            bias = f"{module}.bias"
            if bias in self.types and self.types[bias] != FLOAT:
                self.findings.error(f"{name} types {bias} as {self.types[bias]}, expected FLOAT")
        self._check_kv_cache(stored)
        self._check_sparse(stored)
        for key in sorted(set(self.types) | stored):
            module, _, leaf = key.rpartition(".")
            if leaf in KV_CACHE_LEAVES:
                continue  # the int8 KV cache's tensors (_check_kv_cache)
            allowed = (
                (*TYPE_PARTS[self.types[f"{module}.weight"]], "bias") if module in modules else ()
            )
            if module in modules and leaf not in allowed:
                self.findings.error(
                    f"{key}: unexpected tensor for quantized layer {module} "
                    f"(expected {', '.join(allowed)})"
                )
            elif module not in modules and leaf in PARAMETER_LEAVES:
                self.findings.error(
                    f"{key}: quantization parameter of {module}, whose weight is not typed quantized"
                )
            elif (
                module not in modules
                and not key.endswith(".weight")
                and self.types.get(key, FLOAT) not in (FLOAT, FA_QUANT)
                and not (leaf == "bias" and self.types.get(f"{module}.weight") == W16A16S)
            ):
                self.findings.error(
                    f"{name} types {key} as {self.types[key]}, but only the weight and "
                    f"parameters ({', '.join(PARAMETER_LEAVES)}) of a quantized layer may carry "
                    "a quant type"
                )

    def altered_float_tensors(self) -> set[str]:
        """The W16A16S tensors: pruned by ``float_sparse``, not the original model's values."""
        return {key for key, kind in self.types.items() if kind == W16A16S}

    def _check_sparse(self, stored: set[str]) -> None:
        """W16A16S (``float_sparse``): a pruned linear's ``weight`` is a 2-d float tensor (its
        ``bias``, if any, a 1-d float tensor typed alike); the share of zeros of each weight is
        reported, and a weight without any zero is a warning (msModelSlim's mask zeroes
        ``int(sparse_ratio * numel)`` entries of each weight)."""
        name = self.description_path.name
        for key in sorted(k for k in self.altered_float_tensors() if k in stored):
            module, _, leaf = key.rpartition(".")
            info = self.store.infos[key] if self.store is not None else None
            if leaf not in ("weight", "bias") or info is None:
                self.findings.error(
                    f"{name} types {key} as {W16A16S}: only a linear's weight and bias may be"
                )
                continue
            if leaf == "bias" and self.types.get(f"{module}.weight") != W16A16S:
                self.findings.error(f"{name} types {key} as {W16A16S} but not {module}.weight")
                continue
            assert self.store is not None
            tensor = self.store.get(key)
            if not tensor.is_floating_point() or tensor.dim() != (2 if leaf == "weight" else 1):
                self.findings.error(
                    f"{key} ({W16A16S}): expected a {'2' if leaf == 'weight' else '1'}-d float "
                    f"tensor, stored {tensor.dtype} {list(tensor.shape)}"
                )
            elif leaf == "weight":
                if not bool((tensor == 0).any()):
                    self.findings.note(f"typed {W16A16S} but holding no zero (not pruned?)", key)

    def _check_kv_cache(self, stored: set[str]) -> None:
        """The int8 KV cache (C8, ``dynamic_cache``): ``<attention>.k_proj`` / ``v_proj``'s
        ``kv_cache_scale`` (positive) and ``kv_cache_offset`` (zero: symmetric), one value per
        output feature, typed C8, and the globals ``kv_cache_type`` / ``kv_quant_type`` ``C8``
        exactly when such tensors exist."""
        name = self.description_path.name
        keys = sorted(
            k for k in set(self.types) | stored if k.rpartition(".")[2] in KV_CACHE_LEAVES
        )
        self.kv_cache = sorted({k.rpartition(".")[0] for k in keys})
        for key in keys:
            kind = self.types.get(key)
            if kind != KV_CACHE_TYPE:
                self.findings.error(f"{name} types {key} as {kind}, expected {KV_CACHE_TYPE}")
        for projection in self.kv_cache:
            if projection.rpartition(".")[2] not in ("k_proj", "v_proj"):
                self.findings.error(
                    f"{projection}: KV-cache parameters on a module other than k_proj / v_proj"
                )
            scale, offset = (f"{projection}.{leaf}" for leaf in KV_CACHE_LEAVES)
            if self.store is None or scale not in stored or offset not in stored:
                self.findings.error(f"{projection}: needs both {', '.join(KV_CACHE_LEAVES)}")
                continue
            values, zeros = self.store.get(scale), self.store.get(offset)
            out = self._out_features(projection)
            if (
                values.dim() != 1
                or (out is not None and values.numel() != out)
                or zeros.shape != values.shape
            ):
                self.findings.error(
                    f"{scale} {list(values.shape)} / {offset} {list(zeros.shape)}: expected "
                    f"[{out if out is not None else 'out_features'}] each"
                )
            elif not values.is_floating_point() or not bool((values > 0).all()):
                self.findings.error(f"{scale}: expected positive floating scales")
            elif bool(zeros.any()):
                self.findings.error(f"{offset}: not zero (the C8 cache is symmetric)")
        for key in KV_CACHE_GLOBALS:
            found = self.description.get(key)
            if self.kv_cache and found != KV_CACHE_TYPE:
                self.findings.error(
                    f"{name}: {key} is {found!r}, expected {KV_CACHE_TYPE!r} (the export holds a C8 KV cache)"
                )
            elif not self.kv_cache and found is not None:
                self.findings.error(f"{name}: {key} is {found!r} but no KV-cache tensor is stored")

    def _out_features(self, module: str) -> int | None:
        """A linear's output features from its stored weight (None if not stored)."""
        weight = f"{module}.weight"
        if self.store is None or weight not in self.store.infos:
            return None
        shape = self.store.infos[weight].shape
        rows = shape[0] * (2 if self.types.get(weight) == "W4A8_DYNAMIC" else 1)
        return int(rows)

    def _check_fa_quant(self) -> None:
        """``fa3_quant``'s records: FAQuant tensors' names, dtypes and shapes, the points'
        ``quant_type`` strings and the global ``fa_quant_type`` (fa_quant.py)."""
        infos = {k: (i.dtype, i.shape) for k, i in self.store.infos.items()} if self.store else {}
        for problem in fa_quant_problems(self.description, infos):
            self.findings.error(f"{self.description_path.name}: {problem}")

    def _check_globals(self) -> None:
        name = self.description_path.name
        missing = [key for key in GLOBAL_KEYS if key not in self.description]
        for key in missing:
            self.findings.error(f"{name} lacks the global key {key!r}")
        for key in ("metadata", "optional"):
            if key in self.description and not isinstance(self.description[key], dict):
                self.findings.error(f"{name}: {key} must be an object")
        present = {self.types[f"{m}.weight"] for m in self.modules}
        present |= {W16A16S} if self.altered_float_tensors() else set()
        present = present or {FLOAT}
        model_type = self.description.get("model_quant_type")
        if (
            "model_quant_type" in self.description
            and model_type not in present
            and model_type != model_quant_type(present)  # FLOAT for W4A8_DYNAMIC (msModelSlim)
        ):
            self.findings.warn(
                f"{name}: model_quant_type {model_type!r} is not among the types of its tensors "
                f"{sorted(present)} (set by ext.json_append?); consumers that pick kernels by "
                "model_quant_type may mis-load the layers"
            )
        if (
            self.type_suffix
            and isinstance(model_type, str)
            and self.type_suffix.upper() != model_type
        ):
            self.findings.error(
                f"{name}: the file name says {self.type_suffix} but model_quant_type is {model_type}"
            )
        self._check_group_size(name)

    def _check_group_size(self, name: str) -> None:
        group_size = self.description.get("group_size")
        if "group_size" not in self.description:
            return
        if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 0:
            self.findings.error(
                f"{name}: group_size must be a non-negative integer, got {group_size!r}"
            )
            return
        sizes = sorted(
            {size for m in self.modules if (size := self._group_size(m, self.types[f"{m}.weight"]))}
        )
        if len(sizes) > 1:
            self.findings.warn(
                f"per-group layers use group sizes {sizes} but {name} holds one global group_size "
                f"({group_size}); consumers reading it see one size"
            )
        if sizes and group_size not in sizes:
            self.findings.error(f"{name}: group_size {group_size} but per-group layers use {sizes}")
        if not sizes and group_size != 0:
            self.findings.warn(
                f"{name}: group_size {group_size} but no layer is per-group (expected 0)"
            )

    # --- layers ----------------------------------------------------------------------------

    def quantized_modules(self) -> list[str]:
        return list(self.modules)

    def _shapes(self, module: str) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        if self.store is None:
            return None
        weight = self.store.infos.get(f"{module}.weight")
        scale = self.store.infos.get(f"{module}.weight_scale")
        if weight is None or scale is None:
            return None
        return weight.shape, scale.shape

    def _in_features(self, module: str, kind: str) -> int | None:
        shapes = self._shapes(module)
        if shapes is None or len(shapes[0]) != 2:
            return None
        if kind in MX_TYPES:
            return shapes[0][1] * stored_columns(kind)
        return shapes[0][1] * (2 if kind == "W4A16" else 1)

    def _group_size(self, module: str, kind: str) -> int | None:
        shapes = self._shapes(module)
        in_features = self._in_features(module, kind)
        if shapes is None or in_features is None or len(shapes[1]) != 2 or shapes[1][1] <= 1:
            return None
        return in_features // shapes[1][1] if in_features % shapes[1][1] == 0 else None

    def entry(self, module: str) -> LayerReport:
        kind = self.types[f"{module}.weight"]
        return LayerReport(module, kind, TYPE_BITS[kind], self._group_size(module, kind))

    def decode(self, module: str) -> DecodedLayer | None:
        kind = self.types[f"{module}.weight"]
        bits = TYPE_BITS[kind]
        if kind in ("W8A8", "W8A8_MIX"):
            return decode_w8a8(self, module, kind)
        if kind == "W4A8_DYNAMIC":
            return decode_w4a8(self, module)
        if kind in MX_TYPES:
            return self._decode_mx(module, kind)
        if kind == FP8_TYPE:
            return self._decode_fp8(module)
        names = {part: f"{module}.{part}" for part in PARTS}
        present = [
            self.expect(names[part], (dtype,), None)
            for part, dtype in zip(PARTS, (torch.int8, torch.float32, torch.float32), strict=True)
        ]
        if not all(present) or self.store is None:
            return None
        return self._decode_checked(module, kind, bits, names)

    def _decode_fp8(self, module: str) -> DecodedLayer | None:
        present = [
            self.expect(f"{module}.{part}", (dtype,), None)
            for part, dtype in zip(
                FP8_PARTS, (torch.float8_e4m3fn, torch.float32, torch.float32), strict=True
            )
        ]
        if not all(present) or self.store is None:
            return None
        decoded = decode_fp8(module, *(self.store.get(f"{module}.{part}") for part in FP8_PARTS))
        if isinstance(decoded, str):
            self.findings.error(decoded)
            return None
        return decoded

    def _decode_mx(self, module: str, kind: str) -> DecodedLayer | None:
        present = [
            self.expect(f"{module}.{part}", (dtype,), None)
            for part, dtype in zip(MX_PARTS, mx_dtypes(kind), strict=True)
        ]
        if not all(present) or self.store is None:
            return None
        decoded = decode_mx(
            module,
            kind,
            self.store.get(f"{module}.weight"),
            self.store.get(f"{module}.weight_scale"),
        )
        if isinstance(decoded, str):
            self.findings.error(decoded)
            return None
        return decoded

    def _decode_checked(
        self, module: str, kind: str, bits: int, names: dict[str, str]
    ) -> DecodedLayer | None:
        assert self.store is not None
        weight_shape = self.store.infos[names["weight"]].shape
        scale_shape = self.store.infos[names["weight_scale"]].shape
        if len(weight_shape) != 2 or len(scale_shape) != 2:
            self.findings.error(
                f"{names['weight']} {list(weight_shape)} / {names['weight_scale']} {list(scale_shape)}: "
                "expected 2-D tensors"
            )
            return None
        out_features, columns = weight_shape
        in_features = columns * (2 if kind == "W4A16" else 1)
        groups = scale_shape[1]
        ok = True
        if scale_shape[0] != out_features or groups < 1 or in_features % groups:
            layout = "[out, in/2] (two int4 per byte)" if kind == "W4A16" else "[out, in]"
            self.findings.error(
                f"{names['weight_scale']}: shape {list(scale_shape)} does not fit {names['weight']} "
                f"{list(weight_shape)} ({kind} weight is {layout}; scale is [out, 1] or "
                "[out, in/group_size])"
            )
            ok = False
        ok = self.expect(names["weight_offset"], (torch.float32,), tuple(scale_shape)) and ok
        if not ok:
            return None
        raw = self.store.get(names["weight"])
        codes = unpack_int4_pairs(raw) if kind == "W4A16" else raw
        group_size = None if groups == 1 else in_features // groups
        return DecodedLayer(
            name=module,
            scheme=kind,
            bits=bits,
            group_size=group_size,
            codes=codes.to(torch.int32),
            scale=self.store.get(names["weight_scale"]).to(torch.float32),
            offset=self.store.get(names["weight_offset"]).to(torch.float32),
            g_idx=trivial_g_idx(in_features, in_features // groups),
            scale_dtype=torch.float32,
            tensors={
                "codes": names["weight"],
                "scale": names["weight_scale"],
                "offset": names["weight_offset"],
                "g_idx": f"{module} (implicit groups)",
            },
        )

    def model_dtype(self) -> str | None:
        """The model's dtype named by config.json (``torch_dtype``, or transformers 5's ``dtype``)."""
        config = self.config or {}
        found = config.get("torch_dtype", config.get("dtype"))
        return found if isinstance(found, str) else None

    def activation_of(self, module: str) -> ActivationQuant | None:
        """How the deployed layer ``module`` quantizes its input (``msquant eval`` simulates it):
        W8A8's stored per-tensor ``input_scale`` / ``input_offset``, per-token for the dynamic
        types, None for weight-only types. Call after :meth:`decode` checked the layer."""
        kind = self.types.get(f"{module}.weight")
        if kind in ("W8A8_DYNAMIC", "W4A8_DYNAMIC"):
            return ActivationQuant("per_token")
        if kind in MX_TYPES:
            return ActivationQuant("per_block", value_type=MX_TYPES[kind][1])
        if kind == FP8_TYPE:
            return ActivationQuant("per_token", value_type=FP8_VALUES[1])
        if kind not in ("W8A8", "W8A8_MIX") or self.store is None:
            return None
        scale = float(self.store.get(f"{module}.input_scale")[0])
        offset = float(self.store.get(f"{module}.input_offset")[0])
        if kind == "W8A8_MIX":
            return ActivationQuant("pd_mix", False, scale, offset)
        return ActivationQuant("per_tensor", offset == 0, scale, offset)

    def optional_tensor(self, scope: str, name: str) -> torch.Tensor | None:
        """``optional.<scope>.rotation_map.<name>`` of the description: the file (relative to
        the export) holding the tensor, msModelSlim's layout of the tensors processors ship
        beside the weights (quarot's ``global_rotation`` in ``optional/quarot.safetensors``)."""
        optional = self.description.get("optional")
        entry = optional.get(scope) if isinstance(optional, dict) else None
        rotation_map = entry.get("rotation_map") if isinstance(entry, dict) else None
        if not isinstance(rotation_map, dict) or name not in rotation_map:
            return None
        what = f"{self.description_path.name} optional.{scope}.rotation_map.{name}"
        return self.file_tensor(rotation_map[name], name, what)

    def consumer_notes(self, layer: DecodedLayer) -> None:
        if layer.scheme == "W4A8_DYNAMIC" and parse_expert_linear(layer.name) is None:
            self.findings.note(VLLM_ASCEND_W4A8_LINEAR, layer.name)
        if layer.scheme == "W4A16":
            self.findings.note(VLLM_ASCEND_W4A16, layer.name)
        elif layer.scheme == "W8A16" and layer.group_size is not None:
            self.findings.note(VLLM_ASCEND_PER_GROUP, layer.name)
        if not layer.symmetric:
            self.findings.note(VLLM_ASCEND_ASYM, layer.name)
        if layer.name.rpartition(".")[2] in HEAD_NAMES:
            self.findings.note(QUANTIZED_HEAD, layer.name)

    def schemes(self) -> tuple[dict[str, Hashable], dict[str, str]]:
        schemes: dict[str, Hashable] = {}
        describe: dict[str, str] = {}
        for key, kind in self.types.items():
            if not key.endswith(".weight"):
                continue
            module = key[: -len(".weight")]
            if kind == FLOAT:
                schemes[module], describe[module] = FLOAT, FLOAT
                continue
            group_size = self._group_size(module, kind) if kind in TYPE_BITS else None
            schemes[module] = (kind, group_size)
            describe[module] = f"{kind} " + (f"group {group_size}" if group_size else "per-channel")
        return schemes, describe
