"""Device backends (cpu, cuda, npu) behind one interface; see ``Backend``.

Only this package may touch ``torch.cuda``, ``torch.npu`` or ``torch_npu``; everything else asks a
backend. ``get_backend`` validates that the requested device is present.
"""

from __future__ import annotations

from msquant.backends.base import Backend
from msquant.backends.cpu import CpuBackend
from msquant.backends.cuda import CudaBackend
from msquant.backends.device import DeviceSpec, parse_device
from msquant.backends.npu import NpuBackend, import_torch_npu
from msquant.errors import DeviceError

__all__ = ["Backend", "DeviceSpec", "parse_device", "get_backend", "BACKENDS"]

BACKENDS: dict[str, type[Backend]] = {"cpu": CpuBackend, "cuda": CudaBackend, "npu": NpuBackend}


def get_backend(device: str | DeviceSpec) -> Backend:
    """The backend for a device string, after checking the device exists in this process.

    :raises DeviceError: for malformed strings and devices that are not present.
    :raises DeviceError: also for several devices: one process drives one device.
    """
    spec = parse_device(device) if isinstance(device, str) else device
    if len(spec.indices) > 1:
        raise DeviceError(
            f"device {spec} names {len(spec.indices)} devices, but one process drives one device: "
            f"`msquant quant --device {spec}` starts a process per device (dp_layer_wise), or "
            f"launch with torchrun and pass each process its own device ({spec.kind}:$LOCAL_RANK)"
        )
    backend_cls = BACKENDS[spec.kind]
    if spec.kind == "npu" and import_torch_npu() is None:
        raise DeviceError(
            "device npu requested but torch_npu is not installed; install it with "
            "`pip install msquant[npu]` (matching your CANN and torch versions) or use --device cpu"
        )
    if not backend_cls.is_available():
        raise DeviceError(
            f"device {spec} requested but no {spec.kind} device is available here; use --device cpu"
        )
    count = backend_cls.device_count()
    for index in spec.indices:
        if index >= count:
            raise DeviceError(
                f"device {spec.kind}:{index} requested but only {count} {spec.kind} device(s) exist "
                f"(valid indices 0..{count - 1})"
            )
    return backend_cls(spec)
