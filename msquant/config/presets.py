"""Named configs selectable with ``--quant_type`` (msModelSlim's flag), as plain config mappings.

A preset's ``spec.save`` is filled in from the processor registry: the default saver (the one
saver class declaring ``default_saver``, :func:`msquant.config.processors.default_saver`), so the
engine names no saver here either.
"""

from __future__ import annotations

import copy
from typing import Any

from msquant.config.processors import default_saver
from msquant.plugin.registry import ProcessorRegistry, default_registry

__all__ = ["PRESETS", "PRESET_SHARD_GIB", "preset_config"]

#: The shard size (GiB) a preset's saver writes, msModelSlim's ``part_file_size: 4``.
PRESET_SHARD_GIB = 4

PRESETS: dict[str, dict[str, Any]] = {
    # msModelSlim lab_practice/default/default-w8a16.yaml: per-channel symmetric int8 round-to-nearest.
    "w8a16": {
        "apiversion": "modelslim_v1",
        "metadata": {"config_id": "default-w8a16", "label": {"w_bit": 8, "a_bit": 16}},
        "spec": {
            "process": [
                {
                    "type": "linear_quant",
                    "qconfig": {
                        "weight": {
                            "scope": "per_channel",
                            "dtype": "int8",
                            "symmetric": True,
                            "method": "minmax",
                        }
                    },
                }
            ],
            "save": [],  # the default saver, filled in by preset_config
        },
    },
}


def preset_config(name: str, registry: ProcessorRegistry | None = None) -> dict[str, Any]:
    """A fresh copy of the preset ``name``, saving with the default saver of ``registry``
    (default: every installed processor).

    :raises KeyError: listing the available presets.
    """
    key = name.lower()
    if key not in PRESETS:
        raise KeyError(f"unknown quant_type {name!r}; available: {', '.join(sorted(PRESETS))}")
    config = copy.deepcopy(PRESETS[key])
    saver = default_saver(registry or default_registry())
    config["spec"]["save"] = [{"type": saver.type_name, "part_file_size": PRESET_SHARD_GIB}]
    return config
