"""The rotation numerics (msquant.quant.rotation) against float64 references written out here."""

from __future__ import annotations

import pytest
import torch

from msquant.plugin.numerics import (
    fuse_norm_into_linear,
    hadamard_core_order,
    rotate_input,
    rotate_output,
    rotation_for,
)
from msquant.quant.rotation import (
    block_diagonal,
    hadamard_matrix,
    paley_hadamard,
    random_hadamard,
    sylvester_hadamard,
)

F64 = torch.float64


def _is_hadamard(matrix: torch.Tensor) -> bool:
    n = matrix.shape[0]
    entries_ok = bool(((matrix == 1) | (matrix == -1)).all())
    return entries_ok and torch.equal(matrix @ matrix.T, n * torch.eye(n, dtype=matrix.dtype))


@pytest.mark.parametrize("n", [1, 2, 4, 8, 64, 256])
def test_sylvester_is_the_bit_parity_matrix(n: int) -> None:
    # Sylvester's matrix in natural order: H[i, j] = (-1) ** popcount(i & j)
    reference = torch.tensor(
        [[(-1.0) ** bin(i & j).count("1") for j in range(n)] for i in range(n)], dtype=F64
    )
    assert torch.equal(sylvester_hadamard(n, F64), reference)


def test_sylvester_refuses_other_sizes() -> None:
    with pytest.raises(ValueError, match="power of two, not 12"):
        sylvester_hadamard(12)


@pytest.mark.parametrize("order", [12, 20, 28, 36, 44, 60, 76, 108, 140, 200])
def test_paley_orders_are_hadamard(order: int) -> None:
    matrix = paley_hadamard(order, F64)
    assert matrix is not None and _is_hadamard(matrix)


def test_paley_has_no_matrix_where_its_field_is_not_prime() -> None:
    assert paley_hadamard(52) is None  # q = 51 and q = 25 are not primes
    assert hadamard_core_order(52) is None


@pytest.mark.parametrize(
    ("n", "core"),
    [(64, 1), (576, 36), (896, 28), (1536, 12), (3584, 28), (5120, 20), (13824, 108)],
)
def test_real_model_widths(n: int, core: int) -> None:
    # SmolLM2 576, Qwen2-0.5B 896, Qwen2-1.5B 1536, Qwen2-7B 3584, Qwen2.5-32B 5120, 13824
    assert hadamard_core_order(n) == core
    if n <= 1536:  # the product check of the larger ones costs minutes on a CPU
        assert _is_hadamard(hadamard_matrix(n, dtype=F64))


def test_hadamard_matrix_takes_a_given_core() -> None:
    core = paley_hadamard(12, F64)
    assert core is not None
    assert torch.equal(hadamard_matrix(48, core, F64), torch.kron(core, sylvester_hadamard(4, F64)))
    with pytest.raises(ValueError, match="order 12 does not build size 40"):
        hadamard_matrix(40, core)


def test_hadamard_matrix_names_impossible_sizes() -> None:
    with pytest.raises(ValueError, match="no Hadamard matrix of size 52"):
        hadamard_matrix(52)


@pytest.mark.parametrize("n", [64, 576])
def test_random_hadamard_is_signed_scaled_hadamard(n: int) -> None:
    rotation = random_hadamard(n, dtype=F64)
    assert torch.allclose(rotation @ rotation.T, torch.eye(n, dtype=F64), atol=1e-12)
    # diag(s) @ H.T / sqrt(n) with the signs of torch.randint seeded with 1234
    generator = torch.Generator().manual_seed(1234)
    signs = torch.randint(0, 2, (n,), generator=generator).to(F64) * 2 - 1
    expected = torch.diag(signs) @ hadamard_matrix(n, dtype=F64).T / n**0.5
    assert torch.allclose(rotation, expected, atol=1e-15)
    assert not torch.equal(random_hadamard(n, seed=1, dtype=F64), rotation)


def test_random_hadamard_leaves_the_global_generator_alone() -> None:
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    random_hadamard(64)
    assert torch.equal(torch.rand(3), expected)


def test_block_rotation_repeats_one_matrix() -> None:
    rotation = rotation_for(64, block_size=16, dtype=F64)
    block = random_hadamard(16, dtype=F64)
    assert torch.equal(rotation, torch.block_diag(block, block, block, block))
    with pytest.raises(ValueError, match="block_size 24 does not divide the size 64"):
        rotation_for(64, block_size=24)


def test_block_diagonal() -> None:
    rotation = torch.randn(4, 4, dtype=F64)
    assert block_diagonal(rotation, 4) is rotation
    assert torch.equal(block_diagonal(rotation, 8), torch.block_diag(rotation, rotation))
    with pytest.raises(ValueError, match="size 4 does not divide a dimension of 6"):
        block_diagonal(rotation, 6)


def test_rotations_against_float64_linear_algebra() -> None:
    torch.manual_seed(0)
    weight = torch.randn(24, 16, dtype=F64)
    bias = torch.randn(16, dtype=F64)
    norm = torch.rand(16, dtype=F64) + 0.5
    rotation = random_hadamard(16, dtype=F64)
    head = random_hadamard(4, dtype=F64)
    assert torch.allclose(fuse_norm_into_linear(weight, norm.double()[:16]), weight * norm, atol=0)
    assert torch.allclose(rotate_input(weight, rotation, F64), weight @ rotation, atol=1e-14)
    # a smaller rotation is applied per block (per attention head)
    full = torch.block_diag(*([head] * 4))
    assert torch.allclose(rotate_input(weight, head, F64), weight @ full, atol=1e-14)
    square = torch.randn(16, 8, dtype=F64)
    rotated, rotated_bias = rotate_output(square, bias, rotation, F64)
    assert torch.allclose(rotated, rotation.T @ square, atol=1e-14)
    assert rotated_bias is not None
    assert torch.allclose(rotated_bias, rotation.T @ bias, atol=1e-14)
    assert rotate_output(square, None, rotation, F64)[1] is None


def test_a_rotated_pair_computes_the_same_function() -> None:
    # reader(writer(x)) is unchanged when the writer's output and the reader's input are rotated
    torch.manual_seed(1)
    writer = torch.randn(36, 20, dtype=F64)
    reader = torch.randn(10, 36, dtype=F64)
    x = torch.randn(5, 20, dtype=F64)
    rotation = random_hadamard(36, dtype=F64)
    rotated_writer, _ = rotate_output(writer, None, rotation, F64)
    rotated_reader = rotate_input(reader, rotation, F64)
    assert torch.allclose(
        x @ rotated_writer.T @ rotated_reader.T, x @ writer.T @ reader.T, atol=1e-12
    )


def test_float32_arithmetic_keeps_the_weight_dtype() -> None:
    weight = torch.randn(8, 16, dtype=torch.bfloat16)
    out = rotate_input(weight, random_hadamard(16))
    assert out.dtype == torch.bfloat16
    reference = (weight.float() @ random_hadamard(16)).to(torch.bfloat16)
    assert torch.equal(out, reference)
    with pytest.raises(ValueError, match="cannot fold into a linear of input width 16"):
        fuse_norm_into_linear(weight, torch.ones(8))
