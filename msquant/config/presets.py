"""The practices ``--quant_type`` selects (msModelSlim's flag), shipped as YAML files in
``msquant/data/practices/``.

msModelSlim's ``--quant_type`` takes one of twelve values (:data:`MSMODELSLIM_QUANT_TYPES`) and
looks up a best practice for the model's family, falling back to its ``default`` practices
(``default-w8a16``, ``default-w8a8``). msquant ships one default practice per value it
implements (:data:`PRESETS`): msModelSlim's default practice where it ships one, msquant's own
otherwise (``w4a8``; see each file's header). A value msModelSlim knows but msquant does not
implement is refused naming the implemented ones.

Like msModelSlim, msquant also ships best practices for model families: a file
``<value>-<family>.yaml`` whose ``metadata.verified_model_types`` lists the ``model_type`` values
of ``config.json`` it is for (:data:`FAMILY_PRACTICES`). They are msquant's own, for families
msModelSlim ships no practice for, each chosen by measurement (docs/accuracy.md); a run that
names msModelSlim's adapter (``--model_type``) gets msModelSlim's choice, the default practice.

A preset's ``spec.save`` is filled in from the processor registry: the default saver (the one
saver class declaring ``default_saver``, :func:`msquant.config.processors.default_saver`), so the
engine names no saver here either.
"""

from __future__ import annotations

from importlib import resources
from typing import Any

import yaml

from msquant.config.processors import default_saver
from msquant.config.spec import validate_config
from msquant.contracts.registry import ProcessorRegistry, default_registry

__all__ = [
    "FAMILY_PRACTICES",
    "MSMODELSLIM_QUANT_TYPES",
    "PRESETS",
    "PRESET_SHARD_GIB",
    "preset_config",
    "preset_text",
]

#: The shard size (GiB) a preset's saver writes, msModelSlim's ``part_file_size: 4``.
PRESET_SHARD_GIB = 4

#: msModelSlim 26.1.0's ``--quant_type`` choices (``msmodelslim.core.const.QuantType``).
MSMODELSLIM_QUANT_TYPES = (
    "w4a4", "w4a8", "w4a4c8", "w4a4f8", "w4a8c8", "w8a16",
    "w8a8", "w8a8s", "w8a8c8", "w8a8f8", "w4a4f4", "w16a16s",
)  # fmt: skip

#: The ``--quant_type`` values msquant implements, each with its practice file.
PRACTICE_FILES = {"w8a16": "w8a16.yaml", "w8a8": "w8a8.yaml", "w4a8": "w4a8.yaml"}


def preset_text(name: str) -> str:
    """The YAML text of the practice ``name`` selects (lower case)."""
    folder = resources.files("msquant") / "data" / "practices"
    return (folder / PRACTICE_FILES[name]).read_text(encoding="utf-8")


PRESETS: dict[str, dict[str, Any]] = {
    name: yaml.safe_load(preset_text(name)) for name in PRACTICE_FILES
}


def _family_practices() -> dict[tuple[str, str], str]:
    """``(value, model_type) -> file`` for every ``<value>-<family>.yaml`` practice shipped."""
    folder = resources.files("msquant") / "data" / "practices"
    found: dict[tuple[str, str], str] = {}
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        value, dash, _family = entry.name.removesuffix(".yaml").partition("-")
        if not dash or value not in PRACTICE_FILES or not entry.name.endswith(".yaml"):
            continue
        metadata = yaml.safe_load(entry.read_text(encoding="utf-8")).get("metadata") or {}
        for model_type in metadata.get("verified_model_types") or ():
            found[(value, str(model_type))] = entry.name
    return found


#: msquant's best practices for model families: ``(--quant_type value, config.json model_type)``
#: to the practice file in ``msquant/data/practices/``.
FAMILY_PRACTICES: dict[tuple[str, str], str] = _family_practices()


def practice_file(name: str, model_type: str | None = None) -> str:
    """The practice file ``--quant_type name`` selects for a model of ``model_type`` (its
    ``config.json`` value; ``None``: the default practice)."""
    key = name.lower()
    return FAMILY_PRACTICES.get((key, model_type or ""), PRACTICE_FILES[key])


def preset_config(
    name: str, registry: ProcessorRegistry | None = None, model_type: str | None = None
) -> dict[str, Any]:
    """A fresh copy of the practice ``--quant_type name`` selects for a model of ``model_type``
    (``config.json``'s; ``None``: the default practice), saving with the default saver of
    ``registry`` (default: every installed processor).

    :raises KeyError: for an unknown value or one msquant does not implement, listing those it
        does.
    :raises msquant.ConfigError: when the practice needs a processor ``registry`` lacks.
    """
    key = name.lower()
    if key not in PRESETS:
        available = ", ".join(sorted(PRESETS))
        if key in MSMODELSLIM_QUANT_TYPES:
            raise KeyError(
                f"quant_type {name!r} is one of msModelSlim's but msquant does not implement it; "
                f"implemented: {available}; or pass --config_path YAML"
            )
        raise KeyError(f"unknown quant_type {name!r}; available: {available}")
    registry = registry or default_registry()
    file = practice_file(key, model_type)
    folder = resources.files("msquant") / "data" / "practices"
    config = yaml.safe_load((folder / file).read_text(encoding="utf-8"))
    saver = default_saver(registry)
    config["spec"]["save"] = [{"type": saver.type_name, "part_file_size": PRESET_SHARD_GIB}]
    # a practice naming a processor this installation lacks is refused here, naming the practice
    validate_config(config, registry, f"--quant_type {key} (msquant/data/practices/{file})")
    return config
