"""Accumulation of the GPTQ Hessian ``H = (2 / n) * sum_t x_t x_t^T`` of one linear layer.

Design: the raw sum ``S = X^T X`` is accumulated in float32 and scaled by ``2 / n`` only when the
Hessian is read. This equals msModelSlim's running average (``H *= n / (n + t); n += t;
H += (sqrt(2 / n) x)^T (sqrt(2 / n) x)``) within float32 rounding, and is numerically slightly
better: every token is added with weight 1, with no repeated rescaling of the partial sum.

Small activation batches (e.g. 128 tokens) make the ``X^T X`` product run at a fraction of the
matmul throughput, so rows are first copied into a float32 staging buffer (at most
``buffer_rows`` rows, about 32 MiB) and folded into ``S`` by one larger product when it fills up,
when a batch is larger than the buffer, or when the Hessian is read.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from msquant.errors import QuantizationError
from msquant.quant.finite import all_finite, non_finite_count

__all__ = ["HessianAccumulator"]

_BUFFER_BYTES = 32 * 1024 * 1024
_SUM_BLOCK = 192  # column block width of the symmetric accumulation (at most 8 blocks)


def _block_edges(width: int) -> list[int]:
    """Boundaries of the column blocks used to accumulate only the upper half of ``X^T X``."""
    blocks = min(8, max(1, round(width / _SUM_BLOCK)))
    return [width * i // blocks for i in range(blocks + 1)]


_MIN_BUFFER_ROWS = 256
_MAX_BUFFER_ROWS = 2048


class HessianAccumulator:
    """Running ``X^T X`` of a layer's inputs, with the token count ``n``.

    :param in_features: the layer's input width; ``None`` to take it from the first batch.
    :param name: module name used in error messages.
    :param buffer_rows: staging buffer height (rows folded into the sum per product);
        ``None`` picks ``clamp(32 MiB / (4 * in_features), 256, 2048)``; ``0`` disables staging.
    """

    def __init__(
        self, in_features: int | None = None, name: str = "layer", buffer_rows: int | None = None
    ) -> None:
        if in_features is not None and (isinstance(in_features, bool) or in_features <= 0):
            raise QuantizationError(
                f"{name}: in_features must be a positive int, got {in_features}"
            )
        self.in_features = in_features
        self.name = name
        self._buffer_rows_option = buffer_rows
        self._sum: torch.Tensor | None = None
        self._buffer: torch.Tensor | None = None
        self._pending = 0
        self._batches = 0
        self._mirrored = True
        self.n = 0

    @staticmethod
    def footprint(in_features: int) -> int:
        """Bytes one accumulator of a layer of width ``in_features`` holds once fed: the float32
        ``in x in`` sum and its staging buffer (the default height), for memory estimates."""
        rows = max(_MIN_BUFFER_ROWS, min(_MAX_BUFFER_ROWS, _BUFFER_BYTES // (4 * in_features)))
        return 4 * in_features * (in_features + rows)

    # -- feeding -----------------------------------------------------------------------------

    def add_batch(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> None:
        """Add the rows of ``x`` (shape ``[..., in_features]``, any floating dtype).

        :param attention_mask: optional tensor shaped like ``x.shape[:-1]`` (e.g. ``[batch, seq]``);
            rows whose mask is 0 (padding tokens) are left out and not counted in ``n``.
        :raises QuantizationError: wrong last dimension, non-floating input, a mask of the wrong
            shape, or NaN/Inf among the counted activations.
        """
        self._batches += 1
        # 1. Validate the shape and dtype, fixing in_features on the first batch if unknown.
        shape = tuple(x.shape)
        if x.dim() == 0 or not x.is_floating_point():
            raise QuantizationError(
                f"{self.name}: activations must be a floating tensor [..., in_features], "
                f"got {x.dtype} {shape}"
            )
        if self.in_features is None:
            self.in_features = int(shape[-1])
        if shape[-1] != self.in_features:
            raise QuantizationError(
                f"{self.name}: activations have last dimension {shape[-1]} but the layer expects "
                f"in_features = {self.in_features} (activation shape {shape})"
            )
        rows = x.detach().reshape(-1, self.in_features)
        # 2. Drop padding tokens.
        if attention_mask is not None:
            if tuple(attention_mask.shape) != shape[:-1]:
                raise QuantizationError(
                    f"{self.name}: attention_mask shape {tuple(attention_mask.shape)} does not match "
                    f"the activations' leading dimensions {shape[:-1]} (activation shape {shape})"
                )
            keep = attention_mask.reshape(-1).to(device=rows.device) != 0
            rows = rows[keep]
        count = int(rows.shape[0])
        if count == 0:
            return
        # 3. Refuse non-finite activations: they would silently poison the whole Hessian.
        if not all_finite(rows):
            bad = non_finite_count(rows)
            raise QuantizationError(
                f"{self.name}: calibration activations (batch {self._batches}, shape {shape}) contain "
                f"{bad} NaN/Inf value(s); the layer's inputs overflowed or the calibration data is broken"
            )
        # 4. Stage small batches; fold large ones (and full buffers) into the float32 sum.
        capacity = self._capacity()
        if count >= capacity:
            self.flush()
            self._fold(rows.float())
        else:
            if self._pending + count > capacity:
                self.flush()
            buffer = self._get_buffer(capacity, rows.device)
            buffer[self._pending : self._pending + count].copy_(rows)
            self._pending += count
        self.n += count

    def flush(self) -> None:
        """Fold the staged rows into the running sum (called automatically when needed)."""
        if self._pending and self._buffer is not None:
            self._fold(self._buffer[: self._pending])
            self._pending = 0

    # -- reading -----------------------------------------------------------------------------

    @property
    def nsamples(self) -> int:
        """Number of tokens (rows) accumulated so far; padding tokens excluded."""
        return self.n

    def raw_sum(self) -> tuple[torch.Tensor, int]:
        """The accumulated ``X^T X`` itself (no copy; do not modify) and the token count ``n``.

        :raises QuantizationError: when no batch was ever added.
        """
        self.flush()
        self._mirror()
        if self._sum is None or self.n == 0:
            raise QuantizationError(
                f"{self.name}: the GPTQ Hessian never received a calibration batch; the layer was not "
                f"reached by the calibration forward (check include/exclude patterns and the dataset)"
            )
        return self._sum, self.n

    def hessian(self) -> torch.Tensor:
        """A new float32 tensor ``(2 / n) X^T X`` of shape ``[in_features, in_features]``.

        :raises QuantizationError: when no batch was ever added, or the sum overflowed float32.
        """
        raw, count = self.raw_sum()
        hessian = raw * (2.0 / count)
        if not bool(torch.isfinite(hessian.diagonal()).all()):
            raise QuantizationError(
                f"{self.name}: the GPTQ Hessian overflowed float32 (activations too large) after "
                f"{self.n} tokens"
            )
        return hessian

    def all_reduce(self, reduce_sum: Callable[[torch.Tensor], None]) -> None:
        """Add up this accumulator and its peers in the other processes of a group, in place.

        :param reduce_sum: sums a tensor in place over the processes (e.g.
            :meth:`msquant.plugin.Distributed.all_reduce_sum`); every process must call this, also one
            that received no rows.
        """
        self.flush()
        self._mirror()
        if self._sum is None:
            assert self.in_features is not None, "in_features is unknown: no batch and no size"
            device = self._buffer.device if self._buffer is not None else None
            self._sum = torch.zeros(
                (self.in_features, self.in_features), dtype=torch.float32, device=device
            )
        reduce_sum(self._sum)
        count = torch.tensor([float(self.n)], dtype=torch.float64, device=self._sum.device)
        reduce_sum(count)
        self.n = int(count.item())

    def free(self) -> None:
        """Release the sum and staging buffer (the accumulator is empty afterwards)."""
        self._sum = None
        self._buffer = None
        self._pending = 0
        self._mirrored = True
        self.n = 0

    # -- internals ---------------------------------------------------------------------------

    def _capacity(self) -> int:
        if self._buffer_rows_option is not None:
            return max(int(self._buffer_rows_option), 1)
        assert self.in_features is not None
        rows = _BUFFER_BYTES // (4 * self.in_features)
        return max(_MIN_BUFFER_ROWS, min(_MAX_BUFFER_ROWS, rows))

    def _get_buffer(self, capacity: int, device: torch.device) -> torch.Tensor:
        if self._buffer is None or self._buffer.device != device:
            self.flush()
            assert self.in_features is not None
            self._buffer = torch.empty(
                (capacity, self.in_features), dtype=torch.float32, device=device
            )
        return self._buffer

    def _fold(self, rows: torch.Tensor) -> None:
        """``S += rows^T rows`` (rows float32, on the sum's device)."""
        if self._sum is None:
            assert self.in_features is not None
            self._sum = torch.zeros(
                (self.in_features, self.in_features), dtype=torch.float32, device=rows.device
            )
        rows = rows.to(self._sum.device)
        # Only the blocks on and above the diagonal are accumulated (the sum is symmetric):
        # about 40 % fewer flops than the full product for wide layers; see _mirror.
        edges = _block_edges(self.in_features or rows.shape[1])
        for top, bottom in zip(edges[:-1], edges[1:], strict=True):
            self._sum[top:bottom, top:].addmm_(rows[:, top:bottom].t(), rows[:, top:])
        self._mirrored = False

    def _mirror(self) -> None:
        """Copy the accumulated upper blocks onto the lower ones, making the sum exactly symmetric."""
        if self._sum is None or self._mirrored:
            return
        edges = _block_edges(self._sum.shape[0])
        for top, bottom in zip(edges[:-1], edges[1:], strict=True):
            self._sum[bottom:, top:bottom] = self._sum[top:bottom, bottom:].t()
        self._mirrored = True
