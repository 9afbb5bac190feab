"""``msquant`` command line: ``quant``, ``verify``, ``validate``, ``schema``, ``eval``, ``plan``
and ``report``, one module each; :mod:`~msquant.cli.app` runs them.

Flags of ``quant`` follow ``msmodelslim quant`` so vendor scripts can switch. Exit codes:
0 success, 2 bad input (config, paths, model, data, device; one clear message, no traceback), an
export that fails verification (the offending tensors named) or a full disk, 1 internal failure,
3 a regression against ``--baseline_report``, 130 interrupted (Ctrl-C), 143 terminated (SIGTERM).
"""

from msquant.cli.app import main

__all__ = ["main"]
