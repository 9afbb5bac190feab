"""msquant's built-in processors, installed as ``msquant.processors`` and found via entry points.

Import them as ``msquant.processors.<module>``, never as a bare top-level ``processors`` package.
These modules use only msquant's public API.
"""
