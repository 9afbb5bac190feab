"""Reader of AWQ GEMM checkpoints (``quantization_config.quant_method == "awq"``), written from the
format's description, independently of the AWQ packer.

``quantization_config``: ``bits`` 4, ``group_size`` (one for the model), ``zero_point`` true,
``version`` ``gemm``; ``modules_to_not_convert`` (optional) names linears kept in float. Per
quantized linear ``P``: ``P.qweight`` int32 ``[in, out/8]`` and ``P.qzeros`` int32 ``[G, out/8]``
hold eight unsigned 4-bit values per word along the output dimension, nibble ``k`` being output
``8j + (0, 2, 4, 6, 1, 3, 5, 7)[k]``; ``P.scales`` float16 ``[G, out]``;
``w[o, i] = scales[i // group_size, o] * (q[i, o] - zeros[i // group_size, o])``.
"""

from __future__ import annotations

from collections.abc import Hashable
from pathlib import Path
from typing import Any

import torch

from msquant.plugin import DecodedLayer, ExportReader, Findings, LayerReport
from msquant.plugin.reading import module_of, open_weights, trivial_g_idx, unpack_int32_stream

__all__ = ["AutoAWQReader"]

PARTS = ("qweight", "qzeros", "scales")
#: Where output ``j`` of a block of eight sits among the nibbles of a word (the inverse order).
NIBBLE_OF_OUTPUT = (0, 4, 1, 5, 2, 6, 3, 7)
BITS = 4
UNSIGNED_ZERO = 8  # unsigned code of 0: the signed convention is ``q - 8``


class _Scheme:
    def __init__(self, group_size: int) -> None:
        self.group_size = group_size

    def key(self) -> Hashable:
        return ("awq", self.group_size)

    def describe(self) -> str:
        return f"int4 group {self.group_size} (AWQ)"


class AutoAWQReader(ExportReader):
    """Checks the AutoAWQ config and tensor inventory, and decodes each quantized layer."""

    format_name = "autoawq"

    def __init__(self, directory: Path, findings: Findings, config: dict[str, Any]) -> None:
        super().__init__(directory, findings)
        self.qconfig: dict[str, Any] = dict(config.get("quantization_config") or {})
        self.group_size = self._check_config()
        self.store = open_weights(directory, "model", findings)
        stored = self.store.names() if self.store is not None else []
        self.modules = sorted(
            {m for name in stored if (m := module_of(name, ("qweight",))) is not None}
        )
        self.packed = {f"{m}.{part}" for m in self.modules for part in PARTS}
        for module in self.modules:
            for part in PARTS[1:]:
                if f"{module}.{part}" not in stored:
                    findings.error(f"{module}.{part} is missing (layer {module} has a qweight)")

    def _check_config(self) -> int:
        q = self.qconfig
        if q.get("bits", q.get("w_bit")) != BITS:
            self.findings.error(f"quantization_config bits is {q.get('bits')!r}; AWQ stores 4")
        if q.get("zero_point") is not True:
            self.findings.error("quantization_config zero_point must be true (msquant reads it so)")
        if str(q.get("version", "gemm")).lower() != "gemm":
            self.findings.error(f"AWQ version {q.get('version')!r}: msquant reads the gemm layout")
        group_size = q.get("group_size", q.get("q_group_size"))
        if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size <= 0:
            self.findings.error(f"quantization_config group_size must be > 0, got {group_size!r}")
            return 0
        return group_size

    def quantized_modules(self) -> list[str]:
        return list(self.modules)

    def entry(self, module: str) -> LayerReport:
        return LayerReport(module, "awq int4", BITS, self.group_size or None)

    def schemes(self) -> tuple[dict[str, Hashable], dict[str, str]]:
        return self.hf_schemes(self.modules, lambda module: _Scheme(self.group_size))

    def decode(self, module: str) -> DecodedLayer | None:
        if self.store is None or not self.group_size:
            return None
        qweight = self.store.infos[f"{module}.qweight"]
        scales = self.store.infos.get(f"{module}.scales")
        if scales is None or len(qweight.shape) != 2 or len(scales.shape) != 2:
            return None
        in_features, out_features = qweight.shape[0], scales.shape[1]
        if in_features % self.group_size or out_features % 8:
            self.findings.error(
                f"{module}: [in {in_features}, out {out_features}] does not fit group_size "
                f"{self.group_size} and eight outputs per word"
            )
            return None
        groups = in_features // self.group_size
        shapes = {
            "qweight": ((torch.int32,), (in_features, out_features // 8)),
            "qzeros": ((torch.int32,), (groups, out_features // 8)),
            "scales": ((torch.float16,), (groups, out_features)),
        }
        if not all(self.expect(f"{module}.{p}", *shapes[p]) for p in PARTS):
            return None
        codes = self._unpack(self.store.get(f"{module}.qweight"), out_features)
        zeros = self._unpack(self.store.get(f"{module}.qzeros"), out_features)
        scale = self.store.get(f"{module}.scales")
        return DecodedLayer(
            name=module,
            scheme="awq int4",
            bits=BITS,
            group_size=self.group_size,
            codes=(codes - UNSIGNED_ZERO).t().contiguous(),
            scale=scale.to(torch.float32).t().contiguous(),
            offset=(zeros - UNSIGNED_ZERO).to(torch.float32).t().contiguous(),
            g_idx=trivial_g_idx(in_features, self.group_size),
            scale_dtype=scale.dtype,
            tensors={
                "codes": f"{module}.qweight",
                "scale": f"{module}.scales",
                "offset": f"{module}.qzeros",
                "g_idx": f"(i // {self.group_size})",
            },
        )

    @staticmethod
    def _unpack(words: torch.Tensor, out_features: int) -> torch.Tensor:
        """int32 ``[rows, out]`` values in output order from ``[rows, out/8]`` words."""
        nibbles, _ = unpack_int32_stream(words, BITS, out_features, dim=1)
        rows = nibbles.shape[0]
        order = torch.tensor(NIBBLE_OF_OUTPUT)
        return nibbles.reshape(rows, out_features // 8, 8)[:, :, order].reshape(rows, out_features)
