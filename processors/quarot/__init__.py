"""``quarot`` (offline Hadamard rotation of the residual stream) and ``online_quarot`` (refused)."""
