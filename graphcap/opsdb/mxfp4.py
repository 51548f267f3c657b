"""MXFP4 experts in the operand order of graphcap's CUDA kernel (``graphcap.opsdb.cuda``).

Published order (gpt-oss's checkpoints, :func:`graphcap.opsdb.reference.mxfp4_dequantize`):
bytes [E, N, K / 2] (two E2M1 values a byte along K, the low nibble first) and E8M0 scales
[E, N, K / 32]. Operand order: bytes [E, N / 16, K / 64, 32, 16] and scales
[E, N / 16, K / 64, 8, 2, 2], as ``mma.sync.m16n8k16`` holds the weights as its left
operand (and each warp's share of a ``wgmma`` left operand in registers). A 16-row block's
chunk of 64 K is 512 bytes: lane ``4g + t`` holds its 32 values (rows g and g + 8, four
products of 16 K) in 16 bytes, word j (little-endian) for product j. A word's value n is
the block's row ``g + 8 * (n & 1)`` at K ``64c + 16j + 8 * ((n >> 1) & 1) + 2t + (n >> 2)``
(the products' own K order, so the activations stay in theirs); its bits are spread so
that register p of the product (values p and p + 4, a bf16 pair) is one or two shifts and
masks (:data:`SHIFTS`). Its scales: row g's and row g + 8's for the chunk's two
groups of 32 (products 0-1 and 2-3), ``[g, group, row]``. A gate/up projection's blocks
hold eight features each, gate as rows 0-7 and up as rows 8-15, so a lane holds a
feature's gate and up for the same tokens; down keeps its rows.

The kernel applies ``2^(s - 1)`` to a decoded value (the scale and the decode's 2^126 in
one bf16 multiply), so scales above 128 (weights above 12 in magnitude) are refused."""

from __future__ import annotations

import torch

# Value n of a lane's word: the block's row g + 8 * (n & 1), place q = 2 * qh + qe in the
# product's K (8 * qh + 2t + qe).
_NIBBLE = torch.tensor([4 * (n & 1) + 2 * ((n >> 1) & 1) + (n >> 2) for n in range(8)])
MAX_SCALE = 128
# Register p's shifts (left; negative: right) of the 32-bit word that bring its magnitudes
# to bf16 bits 6-8 and 22-24 and its signs to bits 15 and 31 (mxfp4_operands.cuh: operand): one
# mask for registers 0 and 1, two masks and their union for 2 and 3.
SHIFTS = ((0, 0), (6, 6), (3, 2), (-4, 1))


def _bit_places() -> torch.Tensor:
    """[value n, E2M1 bit i] -> the word bit that holds it."""
    places = torch.empty(8, 4, dtype=torch.int64)
    for n in range(8):
        p, high = n & 3, n >> 2
        for i in range(4):
            bf16_bit = 16 * high + (6 + i if i < 3 else 15)
            places[n, i] = bf16_bit - SHIFTS[p][i == 3]
    assert sorted(places.flatten().tolist()) == list(range(32))
    return places


_PLACES = _bit_places()
_BITS_4, _BITS_8 = torch.arange(4, dtype=torch.uint8), torch.arange(8, dtype=torch.uint8)


def block_rows(rows: int, gate_up: bool, interleaved: bool) -> torch.Tensor:
    """Each stored row's published row: gate/up blocks of eight features (gate rows, then
    up rows; gpt-oss's interleaved rows or gate and up halves), else the rows as they are."""
    r = torch.arange(rows)
    if not gate_up:
        return r
    feature, up = 8 * (r // 16) + r % 8, (r % 16 >= 8).long()
    return 2 * feature + up if interleaved else feature + up * (rows // 2)


def why_not(w: torch.Tensor, s: torch.Tensor) -> str | None:
    """Why published-order MXFP4 ``w``, ``s`` cannot take the operand order, or None."""
    e, n, half_k = w.shape
    if n % 16 or (2 * half_k) % 64:
        return (f"needs rows in multiples of 16 and K in multiples of 64 (got {n} rows, "
                f"K {2 * half_k})")
    if s.numel() and int(s.max()) > MAX_SCALE:
        return f"scales above {MAX_SCALE} (weights above 12 in magnitude) would overflow it"
    return None


def operand_order(w: torch.Tensor, s: torch.Tensor, gate_up: bool, interleaved: bool
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Published-order bytes ``w`` [E, N, K / 2] and scales ``s`` in operand order."""
    _refuse_unless_fit(w, s)
    return _reorder(w, s, gate_up, interleaved)


def to_operand_order_(w: torch.Tensor, s: torch.Tensor, gate_up: bool, interleaved: bool
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`operand_order` in place, an expert at a time (no second copy of the
    weights); returns ``w`` and ``s`` viewed in the operand order's shapes."""
    _refuse_unless_fit(w, s)
    if not (w.is_contiguous() and s.is_contiguous()):
        raise ValueError("MXFP4 weights and scales must be contiguous to reorder in place")
    for e in range(w.shape[0]):  # checked once above, not again an expert
        packed, scales = _reorder(w[e:e + 1], s[e:e + 1], gate_up, interleaved)
        w[e].view(-1).copy_(packed.view(-1))
        s[e].view(-1).copy_(scales.view(-1))
    return w.view(w.shape[0], *packed.shape[1:]), s.view(s.shape[0], *scales.shape[1:])


def _refuse_unless_fit(w: torch.Tensor, s: torch.Tensor) -> None:
    why = why_not(w, s)
    if why:
        raise ValueError(f"MXFP4 weights {tuple(w.shape)}: the operand order {why}")


def _reorder(w: torch.Tensor, s: torch.Tensor, gate_up: bool, interleaved: bool
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`operand_order` without its checks."""
    e, n, half_k = w.shape
    k = 2 * half_k
    order = block_rows(n, gate_up, interleaved).to(w.device)
    w, s = w[:, order], s[:, order]
    nib = torch.stack((w & 15, w >> 4), -1).view(e, n // 16, 2, 8, k // 64, 4, 2, 4, 2)
    # [e, R, half, g, c, j, qh, t, qe] -> [e, R, c, g, t, j, half * 4 + 2 * qh + qe]
    nib = nib.permute(0, 1, 4, 3, 7, 5, 2, 6, 8).reshape(e, n // 16, k // 64, 8, 4, 4, 8)
    nib = nib[..., _NIBBLE.to(w.device)]
    bits = (nib.unsqueeze(-1) >> _BITS_4.to(w.device)) & 1  # [.., value, E2M1 bit]
    # each word bit's value bit, eight bits a byte, little-endian
    bits = bits.flatten(-2)[..., torch.argsort(_PLACES.flatten()).to(w.device)]
    packed = (bits.unflatten(-1, (4, 8)) << _BITS_8.to(w.device)).sum(-1, dtype=torch.uint8)
    scales = s.view(e, n // 16, 2, 8, k // 64, 2).permute(0, 1, 4, 3, 5, 2)
    return packed.reshape(e, n // 16, k // 64, 32, 16).contiguous(), scales.contiguous()


def published_order(packed: torch.Tensor, scales: torch.Tensor, gate_up: bool,
                    interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`operand_order`."""
    e, blocks, chunks = packed.shape[:3]
    n, k = 16 * blocks, 64 * chunks
    b = packed.view(e, blocks, chunks, 8, 4, 4, 4)
    bits = ((b.unsqueeze(-1) >> _BITS_8.to(packed.device)) & 1).flatten(-2)  # word bits
    bits = bits[..., _PLACES.flatten().to(packed.device)].unflatten(-1, (8, 4))
    nib = (bits << _BITS_4.to(packed.device)).sum(-1, dtype=torch.uint8)
    nib = nib[..., torch.argsort(_NIBBLE).to(packed.device)]  # [.., half * 4 + q]
    # [e, R, c, g, t, j, half, qh, qe] -> [e, R, half, g, c, j, qh, t, qe]
    nib = nib.view(e, blocks, chunks, 8, 4, 4, 2, 2, 2).permute(0, 1, 6, 3, 2, 5, 7, 4, 8)
    nib = nib.reshape(e, n, k)
    w = nib[..., 0::2] | (nib[..., 1::2] << 4)
    s = scales.permute(0, 1, 5, 3, 2, 4).reshape(e, n, k // 32)
    inverse = torch.argsort(block_rows(n, gate_up, interleaved)).to(packed.device)
    return w[:, inverse].contiguous(), s[:, inverse].contiguous()


def is_operand_order(w: torch.Tensor) -> bool:
    """Whether MXFP4 bytes ``w`` are in operand order (5-D) rather than published (3-D)."""
    return w.dim() == 5
