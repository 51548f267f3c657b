"""The decode attention kernel's grid and tiles (:mod:`graphcap.opsdb.triton.decode`): the
query heads a program takes, the programs a split of the grid has, how many splits each
(row, head block) gets and at which tiles, all from host values (rows, heads, the block
table's width, the device's SMs and shared memory), so a captured grid never changes."""

from __future__ import annotations

import triton

from graphcap.opsdb.triton import counters

_MAX_SPLITS = 32


def head_block(group: int) -> int:
    """Query heads a program takes: its whole GQA group up to 64, at least 16 rows (the
    tensor-core products' least)."""
    return max(16, triton.next_power_of_2(min(group, 64)))


def programs_of(rows: int, heads: int, kv_heads: int) -> int:
    """Programs of one split of the grid: a (row, key/value head, head block) each."""
    group = heads // kv_heads
    return rows * kv_heads * triton.cdiv(group, head_block(group))


# Two key/value buffers of 128-token blocks (the block table's lookup takes half the
# stages: (num_stages - 1) // 2 buffers): 140 KB of shared memory a program at head dim
# 128 in bf16 and 16 query heads, the buffers and 9 KB besides.
DEEP = {"BLOCK_N": 128, "num_warps": 4, "num_stages": 5}


def program_bytes(block_n: int, buffers: int, row_bytes: int, block_h: int,
                  block_d: int) -> int:
    """Shared memory a program asks for, at most: ``buffers`` key and value blocks of
    ``block_n`` tokens of ``row_bytes`` each, and its ``block_h`` query heads' tiles (q,
    the scores and probabilities, the accumulator's layout change) with room for Triton's
    padding. Compiled for sm_90, the bound holds 9-80 KB over the kernel's figure."""
    heads = block_h * (row_bytes + 4 * block_n + 4 * block_d) * 3 // 2
    return 2 * buffers * block_n * row_bytes + heads + 16 * 1024


def deep_bytes(row_bytes: int, block_h: int = 16, block_d: int = 128) -> int:
    """:func:`program_bytes` of :data:`DEEP` tiles (two buffers)."""
    return program_bytes(DEEP["BLOCK_N"], 2, row_bytes, block_h, block_d)


def tiles_for(programs: int, max_len: int, sms: int, shared: int, row_bytes: int = 256,
              block_h: int = 16, block_d: int = 128) -> tuple[dict, int]:
    """The kernel's tiles and split count for ``programs`` (row, head block)s of
    ``block_h`` query heads and rows reading up to ``max_len`` tokens of ``row_bytes`` a
    key (``block_d`` elements), on ``sms`` SMs of ``shared`` bytes of shared memory a
    program. From the H200 sweeps
    (``docs/results/2026-12-05-decode-attention-stages-f89bd59-h200.json``,
    ``...-batches-bd1c1e8-...``): where the rows and heads leave SMs idle (decode at batch 1
    to 16), :data:`DEEP`, one program an SM, split into as many as fill the SMs once
    (qwen3-0.6b at context 1024: batch 8 14.5 us against 16.2 with 3 stages and 5 splits,
    batch 16 22.1 against 26.0; batch 1 at 4096 11.3 against 13.7); else 64-token blocks
    at 2 stages. Where a program cannot have :func:`deep_bytes` (head dim 256 in bf16,
    float32 caches, groups of more than 16 query heads), 128-token blocks at 3 stages (one
    buffer), split; shorter blocks where even one key and one value block would not fit
    (``shared`` 0, unknown: no deep tiles, no block shortened)."""
    if programs <= sms and shared >= deep_bytes(row_bytes, block_h, block_d):
        return dict(DEEP), splits_for(programs, max_len, DEEP["BLOCK_N"], sms, waves=1)
    cfg = ({"BLOCK_N": 128, "num_warps": 4, "num_stages": 3} if programs < sms else
           {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2})
    while shared and cfg["BLOCK_N"] > 16 and \
            program_bytes(cfg["BLOCK_N"], 1, row_bytes, block_h, block_d) > shared:
        cfg = {**cfg, "BLOCK_N": cfg["BLOCK_N"] // 2}  # one key and one value block fit
    return cfg, splits_for(programs, max_len, cfg["BLOCK_N"], sms)


def splits_for(programs: int, max_len: int, block_n: int, sms: int, waves: int = 2) -> int:
    """Splits per (row, head block) for ``programs`` of them: enough programs to fill the
    SMs ``waves`` times over (one wave: no more programs than SMs), no split shorter than
    one block, at most ``_MAX_SPLITS``, and one where the merge's counters would not fit
    (:data:`counters.CAPACITY`)."""
    if programs > counters.CAPACITY:
        return 1
    blocks = triton.cdiv(max(max_len, 1), block_n)
    programs = max(programs, 1)
    wanted = sms // programs if waves == 1 else triton.cdiv(waves * sms, programs)
    return max(1, min(blocks, wanted, _MAX_SPLITS))


def splits_of_tiles(cfg: dict, programs: int, max_len: int, sms: int) -> int:
    """:func:`splits_for` of tiles given by hand (a benchmark's ``tiles=``), as
    :func:`tiles_for` splits the tiles it picks: one wave for two key/value buffers or more
    (``(num_stages - 1) // 2``, :data:`DEEP`'s: a program an SM), else two."""
    deep = (cfg["num_stages"] - 1) // 2 >= 2
    return splits_for(programs, max_len, cfg["BLOCK_N"], sms, waves=1 if deep else 2)


__all__ = ["DEEP", "deep_bytes", "head_block", "program_bytes", "programs_of", "splits_for",
           "splits_of_tiles", "tiles_for"]
