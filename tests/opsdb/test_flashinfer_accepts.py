"""FlashInfer's norm and rope kernels cast every tensor's pointer to the input's dtype
without checking it (csrc/norm.cu, csrc/rope.cu), where the reference and the Triton
kernels take any float weight, residual or key: such calls must never reach them (the
kernel's ``accepts`` declines them, so automatic choice passes over it). Checked without
FlashInfer or a GPU: ``declines`` runs on the host."""

from __future__ import annotations

import torch

from graphcap.opsdb import get_op

BF16 = torch.bfloat16


def test_flashinfer_rms_norm_is_never_given_a_weight_of_another_dtype():
    declines = get_op("rms_norm").kernels["flashinfer"].declines
    x = torch.zeros(2, 64, dtype=BF16)
    assert "not torch.float32" in declines((x, torch.ones(64), 1e-6))
    assert declines((x, torch.ones(64, dtype=BF16), 1e-6)) is None


def test_flashinfer_fused_add_rms_norm_is_never_given_a_residual_or_weight_of_another_dtype():
    declines = get_op("fused_add_rms_norm").kernels["flashinfer"].declines
    x, w = torch.zeros(2, 64, dtype=BF16), torch.ones(64, dtype=BF16)
    assert "residual" in declines((x, torch.zeros(2, 64), w, 1e-6))
    assert "weight" in declines((x, torch.zeros(2, 64, dtype=BF16), w.float(), 1e-6))
    assert declines((x, torch.zeros(2, 64, dtype=BF16), w, 1e-6)) is None


def test_flashinfer_rope_is_never_given_a_key_of_another_dtype_or_strided_indices():
    declines = get_op("rotary_embedding").kernels["flashinfer"].declines
    pos, q = torch.zeros(4, dtype=torch.long), torch.zeros(4, 64, dtype=BF16)
    table = torch.zeros(8, 64)
    assert "reads key as query's dtype" in declines((pos, q, torch.zeros(4, 64), table, 64))
    strided = torch.zeros(8, dtype=torch.long)[::2]
    assert "contiguous" in declines((strided, q, q.clone(), table, 64))
    assert "contiguous" in declines((pos, q, q.clone(), torch.zeros(8, 128)[:, :64], 64))
    assert declines((pos, q, q.clone(), table, 64)) is None


def test_flashinfer_silu_and_mul_is_never_given_rows_it_would_misread():
    # Its kernel takes x's pointer and I only: row t read at t * 2I, in 16-byte vectors
    # from the row's start and from I on.
    declines = get_op("silu_and_mul").kernels["flashinfer"].declines
    assert declines((torch.zeros(4, 128, dtype=BF16),)) is None
    assert declines((torch.zeros(1, 136, dtype=BF16)[:, :128],)) is None  # one row
    assert "packed rows" in declines((torch.zeros(4, 136, dtype=BF16)[:, :128],))
    assert "multiple of 8" in declines((torch.zeros(4, 24, dtype=BF16),))  # I = 12
    assert "multiple of 8" in declines((torch.zeros(4, 8, dtype=BF16),))  # I = 4
    shifted = torch.zeros(4 * 128 + 4, dtype=BF16)[4:].view(4, 128)
    assert "16-byte" in declines((shifted,))


def rows_of(rows: int, width: int, stride: int, start: int = 0) -> torch.Tensor:
    """[rows, width] bf16 rows ``stride`` elements apart, from element ``start`` of a
    fresh (aligned) buffer."""
    return torch.zeros(start + rows * stride, dtype=BF16)[start:].as_strided(
        (rows, width), (stride, 1))


def test_flashinfer_norms_and_rope_are_never_given_rows_off_their_vectors():
    # Their kernels load each row in 16-byte vectors (the norms: of gcd(8, H) bf16
    # elements) from x's pointer plus the row stride: a row starting off a vector's
    # alignment is a misaligned address, which poisons the CUDA context.
    w = torch.ones(64, dtype=BF16)
    norm = get_op("rms_norm").kernels["flashinfer"].declines
    assert norm((rows_of(4, 64, 64), w, 1e-6)) is None
    assert norm((rows_of(4, 64, 72), w, 1e-6)) is None  # padded rows, still aligned
    assert "16-byte" in norm((rows_of(4, 64, 68), w, 1e-6))
    assert "16-byte" in norm((rows_of(4, 64, 64, start=4), w, 1e-6))
    assert "16-byte" in norm((rows_of(4, 64, 64), rows_of(1, 64, 64, start=4)[0], 1e-6))
    assert norm((rows_of(4, 60, 68), torch.ones(60, dtype=BF16), 1e-6)) is None  # vec 4
    fused = get_op("fused_add_rms_norm").kernels["flashinfer"].declines
    assert fused((rows_of(4, 64, 64), rows_of(4, 64, 72), w, 1e-6)) is None
    assert "residual" in fused((rows_of(4, 64, 64), rows_of(4, 64, 68), w, 1e-6))
    rope = get_op("rotary_embedding").kernels["flashinfer"].declines
    pos, table = torch.zeros(4, dtype=torch.long), torch.zeros(8, 64)
    assert rope((pos, rows_of(4, 128, 192), rows_of(4, 64, 192), table, 64)) is None
    assert "key" in rope((pos, rows_of(4, 128, 192), rows_of(4, 64, 196), table, 64))
    assert "query" in rope((pos, rows_of(4, 128, 128, start=4), rows_of(4, 64, 64), table,
                            64))
