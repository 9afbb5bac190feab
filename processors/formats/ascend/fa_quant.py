"""FAQuant in the Ascend export: msModelSlim's attention activation (FA3) quantization records.

What msModelSlim 26.1.0's ``ascendv1_saver`` writes for ``fa3_quant`` (read in
``core/quant_service/modelslim_v1/save/ascendv1.py``, compared with its exports by
``tests/oracle/test_msmodelslim_fa3.py``):

* static (``per_head``) branches: ``<point>.<branch>.scale`` float32 ``[heads, 1]`` (``[1, 1]``
  for a one-head branch such as MLA's ``fa_k`` / ``fa_v``) and ``<point>.<branch>.offset`` zeros
  of the same shape (int8 for an int8 branch, float32 for a float8 ``fp8_e4m3`` one), both typed
  ``FAQuant`` in the description; the global key ``fa_quant_type: "FAKQuant"`` (for either
  dtype);
* dynamic (``per_token``) branches: no tensor, no global key;
* every quantized point: ``<point>.quant_type``, its branches' schemes in one string: the
  branches (Q, K, V in that order) grouped by ``(dtype, strategy)``, each group written
  ``<letters>_<DTYPE>[_DYNAMIC]``, the letters left out when the group is exactly ``QKV``, the
  groups joined by ``_`` (``INT8``, ``INT8_DYNAMIC``, ``QK_INT8_DYNAMIC``, ``Q_INT8_KV_INT8_DYNAMIC``,
  ``Q_FP8_DYNAMIC_KV_FP8``); ``fp8_e4m3`` is written ``FP8``.

The branch letter is the text after the last ``_`` of the branch name (``fa_q``, ``fa3_q`` -> Q).
The ``fa3_quant`` processor hands its results to the Ascend savers through
:class:`FAQuantRecord` in ``ctx.extras[EXTRAS_KEY]``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

__all__ = [
    "BRANCH_LEAVES",
    "EXTRAS_KEY",
    "FA_QUANT",
    "FA_QUANT_GLOBAL",
    "FA_QUANT_STATIC",
    "FAQuantRecord",
    "OFFSET_DTYPES",
    "QUANT_TYPE_NAMES",
    "KNOWN_BRANCHES",
    "branch_letter",
    "fa_quant_problems",
    "parse_point_quant_type",
    "point_quant_type",
    "quant_type_name",
    "static_tensors",
]

#: ``ctx.extras`` key of the :class:`FAQuantRecord`.
EXTRAS_KEY = "fa3_quant"
#: The description type of the static branches' tensors.
FA_QUANT = "FAQuant"
#: The global description key msModelSlim adds when a branch is static, and its value.
FA_QUANT_GLOBAL = "fa_quant_type"
FA_QUANT_STATIC = "FAKQuant"
#: The tensors of a static branch.
BRANCH_LEAVES = ("scale", "offset")
_ORDER = ("Q", "K", "V", "P")
#: qconfig ``dtype`` -> its name in ``quant_type`` strings (msModelSlim's saver's table).
QUANT_TYPE_NAMES = {"int8": "INT8", "fp8_e4m3": "FP8"}
#: A static branch's offset zeros, by its dtype's name (msModelSlim's saver: int8 for INT8
#: scales, float32 for FP8 ones).
OFFSET_DTYPES = {"INT8": torch.int8, "FP8": torch.float32}


def quant_type_name(dtype: str) -> str:
    """``int8`` -> ``INT8``, ``fp8_e4m3`` -> ``FP8``.

    :raises ValueError: for a dtype the export has no FA3 name for.
    """
    try:
        return QUANT_TYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"no FA3 quant_type name for dtype {dtype!r}") from None


def branch_letter(branch: str) -> str:
    """``fa_q`` / ``fa3_q`` -> ``Q`` (msModelSlim: the text after the last underscore)."""
    return branch.rsplit("_", 1)[-1].upper()


def point_quant_type(schemes: Mapping[str, tuple[str, bool]]) -> str:
    """The ``<point>.quant_type`` string of one attention point.

    :param schemes: branch letter (Q, K, V) -> (dtype name such as ``INT8``, dynamic).
    """
    groups: dict[tuple[str, bool], list[str]] = {}
    for letter in _ORDER:
        if letter in schemes:
            groups.setdefault(schemes[letter], []).append(letter)
    parts = []
    for (dtype, dynamic), letters in groups.items():
        text = dtype + ("_DYNAMIC" if dynamic else "")
        joined = "".join(letters)
        parts.append(text if joined == "QKV" else f"{joined}_{text}")
    return "_".join(parts)


def static_tensors(scale: torch.Tensor, dtype_name: str) -> dict[str, torch.Tensor]:
    """A static branch's stored tensors from its per-head scale (any shape with ``heads``
    elements): ``scale`` float32 ``[heads, 1]`` and ``offset`` zeros alike, typed by the
    branch's dtype name (``INT8``: int8, ``FP8``: float32; :data:`OFFSET_DTYPES`)."""
    stored = scale.detach().to(torch.float32).reshape(-1, 1).cpu()
    return {"scale": stored, "offset": torch.zeros_like(stored, dtype=OFFSET_DTYPES[dtype_name])}


@dataclass
class FAQuantRecord:
    """What ``fa3_quant`` decided, for the savers that write it.

    :param tensors: decoder layer name -> full tensor name -> tensor (static branches).
    :param quant_types: point (attention or indexer module name) -> its ``quant_type`` string.
    :param static: whether a branch is static (the global ``fa_quant_type`` key).
    :param writers: the savers that write the record (set in their ``setup``); ``fa3_quant``
        refuses to run without one, since nothing else would store its scales.
    """

    tensors: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    quant_types: dict[str, str] = field(default_factory=dict)
    static: bool = False
    writers: list[str] = field(default_factory=list)


#: The branch names msModelSlim's adapters place (MLA: fa_q/fa_k/fa_v; GLM-5's indexer: fa3_q/fa3_k).
KNOWN_BRANCHES = ("fa_q", "fa_k", "fa_v", "fa3_q", "fa3_k")
_PART = re.compile(r"^([QKVP]*)_?(INT8|FP8|MXFP4|MXFP8|HIFP8)(_DYNAMIC)?$")


def parse_point_quant_type(text: str) -> dict[str, tuple[str, bool]] | None:
    """Branch letter -> (dtype, dynamic) of a ``<point>.quant_type`` string (``QKV`` when its
    letters are left out), or None when the string does not read."""
    found: dict[str, tuple[str, bool]] = {}
    pieces = text.split("_")
    index = 0
    while index < len(pieces):
        letters = ""
        if re.fullmatch(r"[QKVP]+", pieces[index]):
            letters = pieces[index]
            index += 1
        if index >= len(pieces):
            return None
        dtype = pieces[index]
        index += 1
        dynamic = index < len(pieces) and pieces[index] == "DYNAMIC"
        index += 1 if dynamic else 0
        if not _PART.match(dtype):
            return None
        for letter in letters or "QKV":
            if letter in found:
                return None
            found[letter] = (dtype, dynamic)
    return found or None


def fa_quant_problems(
    description: Mapping[str, object],
    infos: Mapping[str, tuple[torch.dtype | None, tuple[int, ...]]],
) -> list[str]:
    """What is wrong with an export's FAQuant records (``msquant verify``).

    :param description: the description file's entries.
    :param infos: stored tensor -> (dtype, shape).
    """
    problems: list[str] = []
    points: dict[str, dict[str, tuple[str, bool]]] = {}
    for key, value in description.items():
        if not key.endswith(".quant_type"):
            continue
        parsed = parse_point_quant_type(value) if isinstance(value, str) else None
        if parsed is None:
            problems.append(
                f"{key}: {value!r} is not an FA3 quant type (e.g. INT8, QK_INT8_DYNAMIC)"
            )
            continue
        points[key[: -len(".quant_type")]] = parsed
    static_seen = False
    scales: dict[str, tuple[int, ...]] = {}
    for key, kind in description.items():
        if kind != FA_QUANT:
            continue
        static_seen = True
        stem, _, leaf = key.rpartition(".")
        point, _, branch = stem.rpartition(".")
        if leaf not in BRANCH_LEAVES or branch not in KNOWN_BRANCHES:
            problems.append(
                f"{key} is typed {FA_QUANT} but is no <attention>.<{'|'.join(KNOWN_BRANCHES)}>."
                f"{{scale,offset}} tensor"
            )
            continue
        schemes = points.get(point)
        letter = branch_letter(branch)
        if schemes is None or letter not in schemes or schemes[letter][1]:
            problems.append(
                f"{key}: {point}.quant_type does not name {letter} as a static branch, so "
                "consumers do not read this tensor"
            )
        info = infos.get(key)
        if info is None:
            continue  # missing tensors are reported by the inventory check
        dtype, shape = info
        value = schemes[letter][0] if schemes is not None and letter in schemes else "INT8"
        expected = torch.float32 if leaf == "scale" else OFFSET_DTYPES.get(value, torch.int8)
        if dtype != expected or len(shape) != 2 or shape[1] != 1:
            problems.append(
                f"{key}: {dtype} {list(shape)}, expected {expected} [heads, 1] (msModelSlim's layout)"
            )
        if leaf == "scale":
            scales[stem] = shape
        elif stem in scales and scales[stem] != shape:
            problems.append(f"{key}: shape {list(shape)} differs from {stem}.scale's")
    for point, schemes in points.items():
        for letter, (_dtype, dynamic) in schemes.items():
            if dynamic:
                continue
            branches = [b for b in KNOWN_BRANCHES if branch_letter(b) == letter]
            if not any(f"{point}.{b}.scale" in description for b in branches):
                problems.append(
                    f"{point}.quant_type names {letter} static but no {point}.fa_{letter.lower()}"
                    ".scale is described"
                )
    marked = description.get(FA_QUANT_GLOBAL)
    if static_seen and marked != FA_QUANT_STATIC:
        problems.append(
            f"{FA_QUANT} tensors are stored but the global {FA_QUANT_GLOBAL} is {marked!r}, "
            f"expected {FA_QUANT_STATIC!r}"
        )
    if marked is not None and not static_seen:
        problems.append(f"{FA_QUANT_GLOBAL} is {marked!r} but no {FA_QUANT} tensor is described")
    return problems
