"""The ``msquant`` console script: parse, configure logging, run the subcommand, turn its outcome
into an exit code.
"""

from __future__ import annotations

import errno
import logging
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from types import FrameType

from msquant.cli.common import (
    EXIT_INPUT,
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    EXIT_TERMINATED,
    peer_lost_message,
)
from msquant.cli.eval import run_eval
from msquant.cli.log import configure_logging
from msquant.cli.parser import build_parser
from msquant.cli.plan import run_plan
from msquant.cli.quant import run_quant
from msquant.cli.report import run_report
from msquant.cli.schema import run_schema
from msquant.cli.validate import run_validate
from msquant.cli.verify import run_verify
from msquant.contracts.distributed import PeerLostError
from msquant.errors import MsquantInputError
from msquant.verify import ExportVerificationError

__all__ = ["COMMANDS", "Terminated", "disk_full", "main"]

logger = logging.getLogger("msquant.cli")


COMMANDS = {
    "quant": run_quant,
    "verify": run_verify,
    "validate": run_validate,
    "schema": run_schema,
    "eval": run_eval,
    "plan": run_plan,
    "report": run_report,
}


class Terminated(BaseException):
    """SIGTERM (a scheduler preempting the job, ``kill``): unwinds like Ctrl-C, so that a
    checkpointed run keeps its work for ``--resume`` and says so."""


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    raise Terminated


@contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """Turn SIGTERM into :class:`Terminated` while a command runs (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def disk_full(exc: BaseException) -> BaseException | None:
    """The error in ``exc``'s chain that says the disk (or quota) is full, or None. Writers
    report it as an :class:`OSError` (``ENOSPC``, ``EDQUOT``) or, from Rust, as text."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in (errno.ENOSPC, errno.EDQUOT):
            return current
        text = str(current)
        if "No space left on device" in text or "Disk quota exceeded" in text:
            return current
        current = current.__cause__ or current.__context__
    return None


def _notes(exc: BaseException) -> str:
    """``; <note>`` for each note the run added to an interruption (what became of its work)."""
    return "".join(f"; {note}" for note in getattr(exc, "__notes__", None) or ())


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``msquant`` console script; returns the exit code."""
    args = build_parser().parse_args(argv)
    configure_logging("DEBUG" if getattr(args, "debug", False) else args.log_level)
    try:
        with _sigterm_unwinds():
            return COMMANDS[args.command](args)
    except MsquantInputError as exc:
        print(f"msquant: error: {exc}", file=sys.stderr)
        return EXIT_INPUT
    except ExportVerificationError as exc:
        print(f"msquant: error: {exc}\nnothing was written to the save path", file=sys.stderr)
        return EXIT_INPUT
    except KeyboardInterrupt as exc:
        print(
            "msquant: interrupted; nothing was written to the save path" + _notes(exc),
            file=sys.stderr,
        )
        return EXIT_INTERRUPTED
    except Terminated as exc:
        print(
            "msquant: terminated (SIGTERM); nothing was written to the save path" + _notes(exc),
            file=sys.stderr,
        )
        return EXIT_TERMINATED
    except PeerLostError as exc:
        print(peer_lost_message(exc), file=sys.stderr)
        return EXIT_INTERNAL
    except SystemExit as exc:  # msquant's commands return their code: this came from a plugin
        print(
            f"msquant: error: SystemExit({exc.code!r}) was raised inside the command (a plugin "
            "calling sys.exit?), so the command did not finish (a quant run writes nothing to its "
            "save path then); exit code 1, not the code it asked for",
            file=sys.stderr,
        )
        return EXIT_INTERNAL
    except Exception as exc:
        full = disk_full(exc)
        if full is not None:
            print(
                f"msquant: error: the disk is full ({' '.join(str(full).split())}); free space, "
                "or choose a --save_path on a disk with room for the export and its checkpoints; "
                "nothing was written to the save path",
                file=sys.stderr,
            )
            return EXIT_INPUT
        logger.exception(
            "internal error (please report it with the command line and this traceback)"
        )
        return EXIT_INTERNAL
