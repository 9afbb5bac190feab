"""``msquant quant`` as a ``dp_layer_wise`` group of one process per device, started here; process 0
writes the export.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from msquant.backends import get_backend
from msquant.cli.common import EXIT_INPUT, EXIT_INTERNAL, peer_lost_message
from msquant.cli.gate import gate_exit_code
from msquant.cli.log import configure_logging
from msquant.cli.quant_options import quant_options
from msquant.contracts.distributed import PeerLostError
from msquant.errors import MsquantInputError
from msquant.report.run_report import REPORT_FILE
from msquant.run.checkpoint.progress import interrupted_work
from msquant.run.launch import spawn
from msquant.run.quantize import quantize
from msquant.verify import ExportVerificationError

if TYPE_CHECKING:
    from torch.multiprocessing import ProcessExitedException

__all__ = ["spawn_quant"]

logger = logging.getLogger("msquant.cli")


def spawn_quant(
    args: argparse.Namespace,
    config: object,
    devices: list[str],
    baseline: dict[str, object] | None,
    tolerance: float | None,
    ppl_tolerance: float | None,
) -> int:
    """Run ``quant`` as a ``dp_layer_wise`` group of one process per device; process 0 writes."""
    from torch.multiprocessing import ProcessExitedException  # noqa: F811 (only typed above)

    for device in dict.fromkeys(devices):  # a missing device fails here, before any process starts
        get_backend(device)
    options = quant_options(args)
    level = logging.getLogger("msquant").level
    logger.info("dp_layer_wise: starting %d processes on %s", len(devices), ", ".join(devices))
    try:
        spawn(_quant_process, len(devices), args.model_path, args.save_path, config, options,
              devices, level)  # fmt: skip
    except ProcessExitedException as exc:
        if exc.exit_code >= 0:
            return int(exc.exit_code)  # the process said why (rank 0 for input errors)
        return _killed(exc, devices, args.save_path)
    report = json.loads((Path(args.save_path) / REPORT_FILE).read_text(encoding="utf-8"))
    logger.info("quantized with %d processes -> %s", len(devices), args.save_path)
    return gate_exit_code(baseline, report, tolerance, ppl_tolerance)


def _killed(exc: ProcessExitedException, devices: list[str], save_path: str) -> int:
    """Say which process of the group a signal ended, how, and what became of the work; the
    exit code is the shell's for that signal (128 + its number: 137 for SIGKILL)."""
    signum = -int(exc.exit_code)
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    print(
        f"msquant: error: process {exc.error_index} of the {len(devices)} of the dp_layer_wise "
        f"group (device {devices[exc.error_index]}, pid {exc.error_pid}) was killed by {name} "
        "(out of memory, or stopped by someone); the other processes were stopped and nothing "
        f"was written to the save path; {interrupted_work(save_path, known=False)}",
        file=sys.stderr,
    )
    return 128 + signum


def _quant_process(
    rank: int,
    model_path: str,
    save_path: str,
    config: object,
    options: dict[str, object],
    devices: list[str],
    level: int,
) -> None:
    """One process of a spawned ``dp_layer_wise`` group (exits with the CLI's exit codes)."""
    configure_logging(logging.getLevelName(level))
    if devices[rank] == "cpu":  # share the cores out instead of oversubscribing them
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // len(devices)))
    try:
        quantize(model_path, save_path, config, device=devices[rank], **options)  # type: ignore[arg-type]
    except MsquantInputError as exc:
        if rank == 0:
            print(f"msquant: error: {exc}", file=sys.stderr)
        sys.exit(EXIT_INPUT)
    except ExportVerificationError as exc:
        print(f"msquant: error: {exc}\nnothing was written to the save path", file=sys.stderr)
        sys.exit(EXIT_INPUT)
    except PeerLostError as exc:
        print(peer_lost_message(exc), file=sys.stderr)
        sys.exit(EXIT_INTERNAL)
