"""msquant exports of the consumer models, made through the public API (``msquant.quantize``).

Each :class:`ExportCase` is one situation of issue 13 §1 (MoE experts left float or in another
scheme, quantized heads, ``-:``-only rules, routers, mixed precision, asymmetric, 3-bit, the
Ascend W8A16 / W4A16 variants); :func:`make_export` runs msquant once per case and session and
keeps the warnings it logged, which the tests check where a consumer cannot serve an export.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from consumer_models import build_consumer_model

import msquant

CALIB = Path(__file__).resolve().parents[1] / "data" / "calib.txt"


@dataclass(frozen=True)
class ExportCase:
    """One export: a model, one ``linear_quant`` step and one saver.

    :param weight: the ``qconfig.weight`` mapping.
    :param exclude: module globs left in float.
    :param dynamic: GPTQModel-style per-module rules of ``linear_quant``.
    :param lm_head: quantize the output head.
    :param model: overrides of the consumer model (e.g. its vocabulary size).
    """

    name: str
    arch: str
    saver: str
    weight: dict[str, Any]
    exclude: tuple[str, ...] = ()
    dynamic: dict[str, Any] = field(default_factory=dict)
    lm_head: bool = False
    model: tuple[tuple[str, Any], ...] = ()

    def config(self) -> dict[str, Any]:
        step: dict[str, Any] = {"type": "linear_quant", "qconfig": {"weight": dict(self.weight)}}
        if self.exclude:
            step["exclude"] = list(self.exclude)
        if self.dynamic:
            step["dynamic"] = dict(self.dynamic)
        if self.lm_head:
            step["lm_head"] = True
        return {
            "apiversion": "modelslim_v1",
            "spec": {"process": [step], "save": [{"type": self.saver}]},
        }


def gptq_weight(bits: int = 4, group: int | None = 128, sym: bool = True) -> dict[str, Any]:
    """A GPTQ ``qconfig.weight``: int4/int8, per-group ``group`` (None: per-channel)."""
    weight: dict[str, Any] = {
        "dtype": "int8" if bits == 8 else "int4",
        "scope": "per_channel" if group is None else "per_group",
        "symmetric": sym,
        "method": "gptq",
    }
    if group is not None:
        weight["ext"] = {"group_size": group}
    return weight


def minmax_weight(
    dtype: str = "int8", group: int | None = None, sym: bool = True
) -> dict[str, Any]:
    """A round-to-nearest ``qconfig.weight`` (what the Ascend examples use)."""
    weight: dict[str, Any] = {
        "dtype": dtype,
        "scope": "per_channel" if group is None else "per_group",
        "symmetric": sym,
        "method": "minmax",
    }
    if group is not None:
        weight["ext"] = {"group_size": group}
    return weight


#: MoE layer 1's experts, whatever the architecture calls the block.
LAYER1_EXPERTS = ("model.layers.1.mlp.experts.*",)
#: A GPTQModel rule giving layer 1's experts 8 bits.
LAYER1_EXPERTS_8BIT = {r"model\.layers\.1\.mlp\.experts\..*": {"bits": 8}}


@dataclass
class Export:
    """A finished export: its folder, the model it came from and msquant's warnings."""

    case: ExportCase
    path: Path
    model_dir: Path
    warnings: list[str]

    def warned(self, *words: str) -> bool:
        """Whether one warning mentions every word (case-insensitive)."""
        return any(all(w.lower() in text.lower() for w in words) for text in self.warnings)


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


class ExportFactory:
    """Builds the consumer models and exports on demand, once per session."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.models: dict[tuple[str, tuple[tuple[str, Any], ...]], Path] = {}
        self.exports: dict[str, Export] = {}

    def model(self, arch: str, overrides: tuple[tuple[str, Any], ...] = ()) -> Path:
        key = (arch, overrides)
        if key not in self.models:
            folder = self.root / "models" / f"{arch}-{len(self.models)}"
            self.models[key] = build_consumer_model(folder, arch, **dict(overrides))
        return self.models[key]

    def __call__(self, case: ExportCase) -> Export:
        if case.name not in self.exports:
            model_dir = self.model(case.arch, case.model)
            save = self.root / "exports" / case.name
            collect = _Collect()
            logger = logging.getLogger("msquant")
            logger.addHandler(collect)
            try:
                msquant.quantize(
                    model_dir, save, case.config(), calib_path=CALIB, max_calib_tokens=64,
                    progress=False,
                )  # fmt: skip
            finally:
                logger.removeHandler(collect)
            self.exports[case.name] = Export(case, save, model_dir, collect.messages)
        return self.exports[case.name]


ExportMaker = Callable[[ExportCase], Export]
