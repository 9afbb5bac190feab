"""Run msModelSlim's ``ssz`` weight quantizer on weights from a safetensors file (oracle only).

Executed by msModelSlim's own interpreter (``$MSQUANT_MSMODELSLIM_VENV/bin/python``), never
imported by msquant or its tests. Each input tensor is named ``<dtype>_<step>_<label>`` (``step``
0: msModelSlim's default); the output file holds, per input, the codes msModelSlim stores and the
scale and offset of its quantization parameters.

Usage: ``python msmodelslim_ssz_probe.py IN.safetensors OUT.safetensors``
"""

from __future__ import annotations

import sys

import torch
from msmodelslim.core.quantizer.base import AutoWeightQuantizer, QConfig
from msmodelslim.ir.qal import QDType, QStorage
from safetensors.torch import load_file, save_file


def main() -> None:
    found: dict[str, torch.Tensor] = {}
    for name, weight in load_file(sys.argv[1]).items():
        dtype, step, _ = name.split("_", 2)
        ext = {"step": int(step)} if int(step) else {}
        config = QConfig(dtype=dtype, scope="per_channel", symmetric=True, method="ssz", ext=ext)
        quantizer = AutoWeightQuantizer.from_config(config)
        quantizer.init_weight(QStorage(dtype=QDType.FLOAT, value=weight))
        codes = quantizer.get_q_storage().value
        params = quantizer.get_q_param().ext
        found[f"{name}.codes"] = codes.to(torch.int8).contiguous()
        found[f"{name}.scale"] = params["scale"].reshape(-1).float().contiguous()
        found[f"{name}.offset"] = params["offset"].reshape(-1).float().contiguous()
    save_file(found, sys.argv[2])


if __name__ == "__main__":
    main()
