"""msModelSlim's calibration dataset names (``spec.dataset: boolq.jsonl``) resolved or refused.

msModelSlim looks a bare ``spec.dataset`` name up in the ``lab_calib`` folder it ships. msquant
does not ship those files (they are msModelSlim's); when msModelSlim is installed in the same
environment its folder is used (located without importing msModelSlim, which would patch pydantic
globally), else ``mix_calib.jsonl`` falls back to msquant's own default set and every other name
is refused with a message saying how to proceed.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import NoReturn

from msquant.errors import CalibrationDataError

__all__ = [
    "MSMODELSLIM_TEXT_SETS",
    "MSMODELSLIM_MEDIA_SETS",
    "msmodelslim_lab_calib",
    "refuse_msmodelslim_dataset",
]

#: The text calibration sets of msModelSlim 26.1.0's ``lab_calib`` folder.
MSMODELSLIM_TEXT_SETS = frozenset(
    {
        "anti_prompt.json",
        "autocodebench.jsonl",
        "boolq.jsonl",
        "calib_prompt.jsonl",
        "cn_en.jsonl",
        "data_list_1.jsonl",
        "data_list_2.jsonl",
        "humaneval_x.jsonl",
        "laos_calib.jsonl",
        "long_calib.jsonl",
        "mix_calib.jsonl",
        "qwen2.5_w8a8_pdmix_anti_prompt.jsonl",
        "qwen2.5_w8a8_pdmix_calib_prompt.jsonl",
        "qwen3_cot.json",
        "qwen3_cot_w4a4.json",
        "teacher_qualification.jsonl",
        "test.json",
    }
)
#: Its image / video / audio sets, for multimodal pipelines msquant does not have.
MSMODELSLIM_MEDIA_SETS = frozenset(
    {"calibImages", "calibVideos", "hunyuanvideo", "wan2_2_i2v", "wan2_2_t2v", "wan2_2_ti2v"}
)


def msmodelslim_lab_calib() -> Path | None:
    """The ``lab_calib`` folder of an installed msModelSlim, found without importing it."""
    try:
        spec = importlib.util.find_spec("msmodelslim")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        folder = Path(location) / "lab_calib"
        if folder.is_dir():
            return folder
    return None


def refuse_msmodelslim_dataset(name: str) -> NoReturn:
    """Raise the message for an msModelSlim dataset name that cannot be resolved here.

    :raises CalibrationDataError: always.
    """
    if name in MSMODELSLIM_MEDIA_SETS:
        raise CalibrationDataError(
            f"spec.dataset {name!r} is one of msModelSlim's image/video calibration sets; "
            "msquant reads image folders only for a vision-language model's config (apiversion "
            "multimodal_vlm_modelslim_v1), so give a text calibration file (.jsonl, .json or "
            ".txt) in spec.dataset or --calib_path"
        )
    raise CalibrationDataError(
        f"spec.dataset {name!r} names a calibration set shipped with msModelSlim (its lab_calib "
        "folder), which msquant does not ship and no installed msModelSlim provides; install "
        "msmodelslim in this environment (msquant then reads its copy), or give a file path in "
        "spec.dataset or --calib_path"
    )
