"""The config ``--quant_type`` selects for a model folder: msquant's best practice for the model's
family where it ships one (``config.json``'s ``model_type``), the default practice otherwise or
when the run names msModelSlim's adapter (``--model_type``), as msModelSlim would pick it."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from msquant.config.presets import PRACTICE_FILES, practice_file, preset_config
from msquant.errors import MsquantInputError
from msquant.verify.base import export_config

__all__ = ["quant_type_config"]

logger = logging.getLogger(__name__)


def config_model_type(model_path: str | Path) -> str | None:
    """``model_type`` of the folder's ``config.json``; ``None`` when it cannot be read (the
    model's loading then says why)."""
    data = export_config(Path(model_path))
    value = data.get("model_type") if data is not None else None
    return value if isinstance(value, str) else None


def quant_type_config(
    quant_type: str, model_path: str | Path, adapter_name: str | None = None
) -> dict[str, Any]:
    """The validated practice ``--quant_type quant_type`` selects for the model at
    ``model_path``; ``adapter_name`` is ``--model_type`` (msModelSlim's choice: its default
    practice, msModelSlim shipping none for the families msquant has one for).

    :raises MsquantInputError: for a value msquant does not implement, listing those it does.
    """
    family = None if adapter_name is not None else config_model_type(model_path)
    try:
        config = preset_config(quant_type, model_type=family)
    except KeyError as exc:
        raise MsquantInputError(str(exc.args[0])) from None
    file = practice_file(quant_type, family)
    default = PRACTICE_FILES[quant_type.lower()]
    if file != default:
        logger.info(
            "--quant_type %s: msquant's best practice for model_type %r (%s, chosen by "
            "measurement, docs/accuracy.md); msModelSlim's --quant_type %s uses its default "
            "practice here (%s; pass --model_type or --config_path to run that one)",
            quant_type.lower(), family, file, quant_type.lower(), default,
        )  # fmt: skip
    return config
