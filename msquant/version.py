"""msquant's version, in a module of its own so that any module can read it without importing the
package root (which imports everything: the public API)."""

__all__ = ["__version__"]

#: msquant's version (PEP 440), written into every export's marker and run report.
__version__ = "0.1.0"
