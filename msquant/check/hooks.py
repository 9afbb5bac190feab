"""Probe forwards see only the check's own hooks.

Other processors of the run may have forward hooks on the layer while a transform checks itself:
in a ``group``, one smoothing processor folds and checks its layer while another's statistics
hooks are still attached, and the probe's tokens would join that processor's statistics (and
change its scales). A probe forward therefore detaches every forward hook and pre-hook of the
layer that the check did not register itself (marked with :func:`check_hook`) and puts them back,
in their order, afterwards.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from torch import nn

__all__ = ["check_hook", "without_foreign_hooks"]

#: The attribute that marks a hook as the check's own.
CHECK_HOOK = "_msquant_check_hook"
#: The hook tables of a module a forward calls.
_TABLES = ("_forward_pre_hooks", "_forward_hooks")

F = TypeVar("F", bound=Callable[..., Any])


def check_hook(hook: F) -> F:
    """Mark ``hook`` as registered by a check: probe forwards keep it."""
    setattr(hook, CHECK_HOOK, True)
    return hook


@contextmanager
def without_foreign_hooks(module: nn.Module) -> Iterator[None]:
    """Detach, for the duration, every forward (pre-)hook under ``module`` not marked by
    :func:`check_hook`; restored in their original order on exit, whatever happens."""
    saved: list[tuple[dict[int, Any], dict[int, Any]]] = []
    for sub in module.modules():
        for table_name in _TABLES:
            table = getattr(sub, table_name)
            if not any(not getattr(hook, CHECK_HOOK, False) for hook in table.values()):
                continue
            before = dict(table)
            for key, hook in before.items():
                if not getattr(hook, CHECK_HOOK, False):
                    del table[key]
            saved.append((table, before))
    try:
        yield
    finally:
        for table, before in saved:  # nothing registers or removes hooks during a forward
            table.clear()
            table.update(before)
