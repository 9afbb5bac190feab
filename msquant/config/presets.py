"""Named configs selectable with ``--quant_type`` (msModelSlim's flag), as plain config mappings."""

from __future__ import annotations

from typing import Any

__all__ = ["PRESETS", "preset_config"]

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
            "save": [{"type": "ascendv1_saver", "part_file_size": 4}],
        },
    },
}


def preset_config(name: str) -> dict[str, Any]:
    """A fresh copy of the preset ``name``.

    :raises KeyError: listing the available presets.
    """
    import copy

    key = name.lower()
    if key not in PRESETS:
        raise KeyError(f"unknown quant_type {name!r}; available: {', '.join(sorted(PRESETS))}")
    return copy.deepcopy(PRESETS[key])
