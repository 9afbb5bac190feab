"""What ``msquant quant``'s flags ask of :func:`msquant.quantize`: its keyword arguments, and one
device per process.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from msquant.backends import parse_device
from msquant.errors import MsquantInputError
from msquant.evaluate.windows import DEFAULT_SEQLEN
from msquant.run.memory_estimate import parse_memory

__all__ = ["quant_options", "process_devices"]


def quant_options(args: argparse.Namespace) -> dict[str, Any]:
    """The keyword arguments of :func:`msquant.quantize` that ``quant``'s flags set (all but the
    paths, the config and the device)."""
    return dict(
        calib_path=args.calib_path,
        trust_remote_code=args.trust_remote_code,
        max_calib_tokens=args.max_calib_tokens,
        progress=not args.no_progress,
        overwrite=args.overwrite,
        verify=not args.no_verify,
        eval_data=args.eval_data,
        eval_seqlen=args.eval_seqlen or DEFAULT_SEQLEN,
        eval_stride=args.eval_stride,
        eval_max_samples=args.eval_max_samples,
        max_memory=None if args.max_memory is None else parse_memory(args.max_memory),
        resume=args.resume,
        checkpoints=not args.no_checkpoints,
        allow_float_export=args.allow_float_export,
        model_type=args.model_type,
    )


#: ``--nproc`` may start this many processes per CPU core (and at least ``MIN_NPROC_LIMIT``).
NPROC_PER_CORE = 4
MIN_NPROC_LIMIT = 8


def max_cpu_processes() -> int:
    """The most processes ``--nproc`` may start on this machine."""
    return max(MIN_NPROC_LIMIT, NPROC_PER_CORE * (os.cpu_count() or 1))


def process_devices(device: str, nproc: int | None) -> list[str]:
    """One device string per process: several device indices start one process each
    (``npu:0,1,2,3``); ``--nproc N`` starts N processes on the CPU. Under torchrun (``WORLD_SIZE``
    set) this process is already one of the group: one device."""
    spec = parse_device(device)
    if "WORLD_SIZE" in os.environ:
        if len(spec.indices) > 1 or (nproc or 1) > 1:
            raise MsquantInputError(
                "under torchrun each process takes one device (e.g. --device npu:$LOCAL_RANK); "
                "drop --nproc and the device list"
            )
        return [device]
    if len(spec.indices) > 1:
        if nproc is not None and nproc != len(spec.indices):
            raise MsquantInputError(
                f"--nproc {nproc} does not match the {len(spec.indices)} devices of {device}"
            )
        return [f"{spec.kind}:{index}" for index in spec.indices]
    if nproc is not None and nproc > 1 and spec.kind != "cpu":
        raise MsquantInputError(
            f"--nproc {nproc} on {spec.kind}: name the devices instead, e.g. "
            f"--device {spec.kind}:{','.join(map(str, range(nproc)))}"
        )
    most = max_cpu_processes()
    if nproc is not None and nproc > most:
        raise MsquantInputError(
            f"--nproc {nproc}: at most {most} processes on this machine ({NPROC_PER_CORE} per CPU "
            f"core, {os.cpu_count()} core(s); at least {MIN_NPROC_LIMIT}): each process holds a "
            "decoder layer and its share of the calibration activations, and more processes than "
            "cores only wait on each other"
        )
    return [device] * (nproc or 1)
