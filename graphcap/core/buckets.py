"""Capture shapes: the prefill token ladder and the choice of a bucket for a batch."""

from __future__ import annotations

from graphcap.core.checks import as_int

# (start, stop, step) rungs of SGLang's prefill ladder; past 4096 the step is 512.
_RUNGS = ((4, 32, 4), (48, 256, 16), (288, 512, 32), (576, 1024, 64), (1280, 4096, 256))
_MOST = 4096 + 512 * 1024  # the largest max_tokens of a ladder: 1074 shapes


def prefill_ladder(max_tokens: int, name: str = "max_tokens",
                   instead: str = "buckets= with the sizes to capture") -> list[int]:
    """Token buckets up to ``max_tokens`` (which is always the last one), ascending
    (``name``: what the messages call it; ``instead``: what to give instead of a ladder
    too long to build).

    4..32 step 4, 48..256 step 16, 288..512 step 32, 576..1024 step 64, 1280..4096 step
    256, then step 512: 42 shapes for 2048.
    """
    max_tokens = as_int(max_tokens, name)
    if max_tokens < 1:
        raise ValueError(f"{name} must be >= 1, got {max_tokens}")
    if max_tokens > _MOST:  # a shape a graph each: not a list to build in memory
        raise ValueError(f"{name}={max_tokens} would capture {50 - (4096 - max_tokens) // 512}"
                         f" shapes (the ladder steps by 512 past 4096 tokens; at most "
                         f"{_MOST} tokens): give {instead}")
    sizes = [n for start, stop, step in _RUNGS for n in range(start, stop + 1, step)]
    sizes += list(range(4096 + 512, max_tokens + 1, 512))
    ladder = [n for n in sizes if n < max_tokens]
    return ladder + [max_tokens]


def check_ladder(buckets, name: str = "buckets", item: str = "bucket") -> list[int]:
    """Validate user buckets (``name``, each an ``item``): positive integers (no float is
    rounded), returned sorted without duplicates."""
    if isinstance(buckets, (str, bytes)) or not hasattr(buckets, "__iter__"):
        raise ValueError(f"{name} must be a list of positive integers, got {buckets!r}")
    ladder = sorted({as_int(b, f"{name}: every {item}") for b in buckets})
    if not ladder or ladder[0] < 1:
        raise ValueError(f"{name} must be a non-empty list of positive integers, got "
                         f"{buckets!r}")
    return ladder


def pick_bucket(num_tokens: int, ladder: list[int], max_pad_ratio: float = 2.0
                ) -> tuple[int | None, str | None]:
    """The smallest bucket holding ``num_tokens``, or (None, reason) to run eagerly:
    'too_many_tokens' past the largest bucket, 'padding' when the bucket is more than
    ``max_pad_ratio`` times the tokens."""
    for bucket in ladder:
        if bucket >= num_tokens:
            if bucket > max_pad_ratio * num_tokens:
                return None, "padding"
            return bucket, None
    return None, "too_many_tokens"


def decode_ladder(max_batch: int) -> list[int]:
    """Batch buckets of decode up to ``max_batch`` (always the last), ascending: every
    size to 4, then each about 1.5x the one before (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48,
    64, ...), so a batch pads by at most half."""
    max_batch = as_int(max_batch, "max_batch")
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    sizes, power = [1, 2, 3], 4
    while power < max_batch:  # 4, 6, 8, 12, 16, 24, ...: powers of two and 1.5 times them
        sizes += [power, power * 3 // 2]
        power *= 2
    return [s for s in sizes if s < max_batch] + [max_batch]
