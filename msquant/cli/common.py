"""What the subcommands share: exit codes, argument types, the parser class, and the message of a
lost ``dp_layer_wise`` process.
"""

from __future__ import annotations

import argparse

from msquant.contracts.distributed import PeerLostError

__all__ = ["EXIT_OK", "bool_flag", "positive_int", "Parser", "peer_lost_message"]


EXIT_OK, EXIT_INTERNAL, EXIT_INPUT, EXIT_INTERRUPTED, EXIT_TERMINATED = 0, 1, 2, 130, 143


def bool_flag(text: str) -> bool:
    """``True``/``False`` as msModelSlim spells them (also 1/0, yes/no, on/off), for argparse."""
    value = text.strip().lower()
    if value in ("true", "1", "yes", "on"):
        return True
    if value in ("false", "0", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected True or False, got {text!r}")


def positive_int(text: str) -> int:
    """A positive integer, for argparse (a usage error otherwise)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


class Parser(argparse.ArgumentParser):
    """ArgumentParser whose usage errors exit with 2 and one line (argparse's default is 2 too)."""


def peer_lost_message(exc: PeerLostError) -> str:
    """One line for a ``dp_layer_wise`` process whose group lost a member, with the way on (what
    the run noted became of its work, when it got that far)."""
    notes = [str(note) for note in getattr(exc, "__notes__", None) or ()]
    if notes:
        return (
            f"msquant: error: {exc}; nothing was written to the save path; "
            + "; ".join(notes)
            + " (once the cause is fixed)"
        )
    return (
        f"msquant: error: {exc}; nothing was written to the save path. Once the cause is fixed, "
        "rerun the same command with --resume to continue after the last finished layer "
        "(runs that write no checkpoints start over)"
    )
