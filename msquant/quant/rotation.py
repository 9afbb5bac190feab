"""Hadamard rotations folded into a model's weights (QuaRot): pure numerics.

Rotating the residual stream of a pre-norm transformer by an orthogonal matrix ``R`` leaves its
outputs unchanged when every weight that reads the stream is multiplied by ``R`` on its input side
and every weight that writes it by ``R^T`` on its output side, once the RMSNorm scales have been
folded into the linears that read them (an RMSNorm with unit scale commutes with ``R``). A
Hadamard ``R`` spreads each channel over all of them, which flattens the outliers that make
activations and weights hard to quantize.

Conventions (``x`` a row vector of the stream, a linear computes ``x @ W.T + b``):

* a reader's weight becomes ``W @ R`` (:func:`rotate_input`), the embedding table ``E @ R``;
* a writer's weight becomes ``R.T @ W`` and its bias ``R.T @ b`` (:func:`rotate_output`);
* a smaller ``R`` than the dimension is applied block-diagonally (per attention head, or
  ``block_size`` blocks).

The matrices follow msModelSlim's construction (learned from running it): ``diag(s) @ H.T /
sqrt(n)`` with ``H = kron(H_k, H_m)``, ``H_m`` Sylvester's Hadamard matrix of the power-of-two
factor, ``H_k`` a Hadamard matrix of order ``k`` for the rest (sizes such as 576 = 36 x 16), and
``s`` random signs drawn with ``torch.randint(0, 2, (n,))`` from a generator seeded with 1234.
For powers of two the result equals msModelSlim's to the bit; for other sizes msquant builds
``H_k`` itself (Paley's constructions), which differs from the tables msModelSlim ships but is
an equally valid Hadamard matrix. Arithmetic is float32 (msModelSlim's), unless asked otherwise.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "DEFAULT_ROTATION_SEED",
    "block_diagonal",
    "fuse_norm_into_linear",
    "hadamard_core_order",
    "hadamard_matrix",
    "is_power_of_two",
    "paley_hadamard",
    "random_hadamard",
    "rotate_input",
    "rotate_output",
    "rotation_for",
    "sylvester_hadamard",
]

#: The seed of the random signs (msModelSlim's ``create_rot`` default).
DEFAULT_ROTATION_SEED = 1234


def is_power_of_two(n: int) -> bool:
    """Whether ``n`` is 1, 2, 4, 8, ..."""
    return n > 0 and n & (n - 1) == 0


def sylvester_hadamard(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Sylvester's ``n x n`` Hadamard matrix of ``+-1`` (natural order; symmetric).

    :raises ValueError: when ``n`` is not a power of two.
    """
    if not is_power_of_two(n):
        raise ValueError(f"Sylvester's construction needs a power of two, not {n}")
    matrix = torch.ones(1, 1, dtype=dtype)
    while matrix.shape[0] < n:
        matrix = torch.cat([torch.cat([matrix, matrix], 1), torch.cat([matrix, -matrix], 1)], 0)
    return matrix


def _is_prime(q: int) -> bool:
    if q < 2:
        return False
    return all(q % d for d in range(2, math.isqrt(q) + 1))


def _jacobsthal(q: int) -> torch.Tensor:
    """``Q[i, j] = chi(j - i)`` over the prime field of ``q`` elements (``chi`` the quadratic
    character: 0 for 0, 1 for non-zero squares, -1 otherwise)."""
    squares = {(x * x) % q for x in range(1, q)}
    chi = torch.tensor([0.0] + [1.0 if a in squares else -1.0 for a in range(1, q)])
    index = (torch.arange(q)[None, :] - torch.arange(q)[:, None]) % q
    return chi[index]


def paley_hadamard(order: int, dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
    """A Hadamard matrix of ``order`` from Paley's constructions over a prime field, or None.

    Paley I (``q = order - 1`` prime, ``q = 3 mod 4``) and Paley II (``q = order / 2 - 1`` prime,
    ``q = 1 mod 4``) give orders such as 12, 20, 28, 36, 44, 60, 76, 108, 140, 200.
    """
    q = order - 1
    if _is_prime(q) and q % 4 == 3:
        jac = _jacobsthal(q)
        core = torch.zeros(order, order)
        core[0, 1:] = 1.0
        core[1:, 0] = -1.0
        core[1:, 1:] = jac
        return (core + torch.eye(order)).to(dtype)
    q = order // 2 - 1
    if order % 2 == 0 and _is_prime(q) and q % 4 == 1:
        jac = _jacobsthal(q)
        conference = torch.zeros(q + 1, q + 1)
        conference[0, 1:] = 1.0
        conference[1:, 0] = 1.0
        conference[1:, 1:] = jac
        plus = torch.tensor([[1.0, -1.0], [-1.0, -1.0]])
        minus = torch.tensor([[1.0, 1.0], [1.0, -1.0]])
        blocks = torch.where(
            conference[:, :, None, None] == 0,
            plus,
            conference[:, :, None, None] * minus,
        )
        return blocks.permute(0, 2, 1, 3).reshape(order, order).to(dtype)
    return None


def hadamard_core_order(n: int) -> int | None:
    """The order ``k`` of the non-power-of-two factor msquant uses for an ``n x n`` Hadamard
    matrix (``n = k * 2^m``): 1 for powers of two, else the smallest multiple of ``n``'s odd
    part dividing ``n`` that Paley's constructions reach; None when there is none."""
    if n < 1:
        return None
    if is_power_of_two(n):
        return 1
    odd = n
    while odd % 2 == 0:
        odd //= 2
    k = odd
    while k <= n:
        if k % 4 == 0 and paley_hadamard(k) is not None:
            return k
        k *= 2
    return None


def hadamard_matrix(
    n: int, core: torch.Tensor | None = None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """An ``n x n`` Hadamard matrix of ``+-1``: ``kron(H_k, H_m)`` with ``H_m`` Sylvester's.

    :param core: the order-``k`` factor to use (any Hadamard matrix whose order divides ``n`` with
        a power-of-two quotient); default: Sylvester's for powers of two, else Paley's of order
        :func:`hadamard_core_order`.
    :raises ValueError: when no such matrix can be built (the message names the size).
    """
    if core is None:
        order = hadamard_core_order(n)
        if order is None:
            raise ValueError(
                f"no Hadamard matrix of size {n}: msquant builds sizes k * 2^m with k a power of "
                "two or a Paley order (k - 1 a prime = 3 mod 4, or k / 2 - 1 a prime = 1 mod 4)"
            )
        core = torch.ones(1, 1) if order == 1 else paley_hadamard(order)
        assert core is not None
    k = core.shape[0]
    if n % k or not is_power_of_two(n // k):
        raise ValueError(f"a Hadamard factor of order {k} does not build size {n}")
    return torch.kron(core.to(dtype), sylvester_hadamard(n // k, dtype))


def random_hadamard(
    n: int,
    seed: int = DEFAULT_ROTATION_SEED,
    core: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The orthogonal ``n x n`` rotation ``diag(s) @ H.T / sqrt(n)``, ``s`` random signs.

    The signs are ``2 * torch.randint(0, 2, (n,)) - 1`` from a CPU generator seeded with
    ``seed`` (the global generator is left alone), as msModelSlim draws them after seeding.
    """
    generator = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (n,), generator=generator).to(dtype) * 2 - 1
    matrix = hadamard_matrix(n, core, dtype)
    return (signs[:, None] * matrix.T) / torch.tensor(float(n), dtype=dtype).sqrt()


def rotation_for(
    n: int,
    block_size: int = -1,
    seed: int = DEFAULT_ROTATION_SEED,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The rotation of an ``n``-wide stream: one random Hadamard matrix (``block_size`` -1), or
    ``n / block_size`` copies of one of size ``block_size`` on the diagonal.

    :raises ValueError: when ``block_size`` does not divide ``n``, or no matrix has the size.
    """
    if block_size == -1:
        return random_hadamard(n, seed, dtype=dtype)
    if block_size < 1 or n % block_size:
        raise ValueError(f"block_size {block_size} does not divide the size {n}")
    return block_diagonal(random_hadamard(block_size, seed, dtype=dtype), n)


def block_diagonal(rotation: torch.Tensor, size: int) -> torch.Tensor:
    """``rotation`` repeated on the diagonal of a ``size x size`` matrix (itself if it fits).

    :raises ValueError: when the rotation's size does not divide ``size``.
    """
    block = rotation.shape[0]
    if block == size:
        return rotation
    if size % block:
        raise ValueError(f"a rotation of size {block} does not divide a dimension of {size}")
    return torch.block_diag(*([rotation] * (size // block)))


def fuse_norm_into_linear(
    weight: torch.Tensor, norm_weight: torch.Tensor, compute_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``weight * norm_weight`` over the input columns: the linear then reads a unit-scale norm.

    :raises ValueError: when the norm's width differs from the linear's input width.
    """
    if norm_weight.dim() != 1 or norm_weight.shape[0] != weight.shape[1]:
        raise ValueError(
            f"a norm of shape {list(norm_weight.shape)} cannot fold into a linear of input "
            f"width {weight.shape[1]}"
        )
    scale = norm_weight.to(device=weight.device, dtype=compute_dtype)
    return (weight.to(compute_dtype) * scale).to(weight.dtype)


def rotate_input(
    weight: torch.Tensor, rotation: torch.Tensor, compute_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``weight @ R`` (R block-diagonal to the input width): a linear (or an embedding table)
    that reads, or produces, the rotated stream."""
    full = block_diagonal(rotation, weight.shape[1]).to(device=weight.device, dtype=compute_dtype)
    return torch.matmul(weight.to(compute_dtype), full).to(weight.dtype)


def rotate_output(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    rotation: torch.Tensor,
    compute_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(R.T @ weight, R.T @ bias)`` (R block-diagonal to the output width): a linear whose
    output is the rotated stream."""
    full = block_diagonal(rotation, weight.shape[0]).to(device=weight.device, dtype=compute_dtype)
    rotated = torch.matmul(full.T, weight.to(compute_dtype)).to(weight.dtype)
    if bias is None:
        return rotated, None
    return rotated, torch.matmul(full.T, bias.to(compute_dtype)).to(bias.dtype)
