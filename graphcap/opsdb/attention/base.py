"""Attention backends: per-batch metadata prepared outside any graph, a forward inside it.

A backend's ``metadata(num_tokens, num_slots, device)`` allocates the static buffers of one
shape (a token bucket T and R request slots) once; ``meta.update(seq_lens)`` rewrites them
for the next batch on the host side, before capture or replay: request offsets with unused
slots as zero-length sentinels parked at the real token count, a validity mask of real
rows, and whatever the backend plans (FlashInfer's ``plan()``). ``forward(q, k, v, out,
meta, scale)`` reads only those buffers, so it can be captured once and replayed for
every batch that fits the shape. Rows past the real tokens (padding) come out zero.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from graphcap.core.checks import check_lengths
from graphcap.core.pinned import HOST_BUFFERS, HostRows
from graphcap.errors import UnsupportedStrategy
from graphcap.opsdb.attention.variant import PLAIN, Variant
from graphcap.opsdb.spec import OpInputError, unavailable

# A shape's offsets are written into HOST_BUFFERS host buffers in turn (core.pinned); the
# updates of one shape are issued on one stream, as its graphs replay on one.


class AttentionMetadata:
    """Static buffers for one (tokens, slots) shape, rewritten by ``update``."""

    def __init__(self, backend: AttentionBackend, num_tokens: int, num_slots: int,
                 device: torch.device | str):
        if num_tokens < 1 or num_slots < 1:
            raise OpInputError(f"attention metadata needs num_tokens >= 1 and num_slots >= 1, "
                               f"got {num_tokens} and {num_slots}")
        self.backend = backend
        self.num_tokens, self.num_slots = num_tokens, num_slots
        self.device = torch.device(device)
        self.cu_seqlens = torch.zeros(num_slots + 1, dtype=torch.int32, device=self.device)
        # Rewriting a host buffer before its copy ran would hand the previous replay the
        # next batch's offsets: a round of them shares one event (core.pinned).
        self._host = HostRows(HOST_BUFFERS, (num_slots + 1,), torch.int32, self.device)
        self.cu_seqlens_host = self._host.tensors[0]  # the last update's offsets
        self.valid = torch.zeros(num_tokens, dtype=torch.bool, device=self.device)
        self._rows = torch.arange(num_tokens, device=self.device)
        self.seq_lens: list[int] = []
        self.num_real_tokens = 0
        self.attended = False  # graphcap::attention ran on this metadata (eager or capture)

    def update(self, seq_lens: Sequence[int] | torch.Tensor, derive: bool = True,
               checked: bool = False) -> AttentionMetadata:
        """Fill the buffers for a batch of requests with these lengths (host values).

        The host side writes the offsets and copies them to the device (one copy) and
        runs the backend's ``plan``; ``derive=False`` leaves the buffers computed from the
        offsets on the device (:meth:`derive`) to the caller, e.g. to a captured graph
        that derives them itself before attention, so a replay pays no launch for them.
        ``checked``: a list of ints the caller checked against this shape already (a
        runner's batch)."""
        lens = seq_lens if checked else validate_seq_lens(seq_lens, self.num_tokens,
                                                           self.num_slots)
        total = sum(lens)
        if torch.compiler.is_compiling():
            # Traced (a compiled model preparing its own metadata): Dynamo takes a numpy
            # view for a tensor of its own and would drop writes through it: the next
            # buffer, written with a torch op.
            turn = self._host.take()
            padded = lens + [0] * (self.num_slots - len(lens))
            self.cu_seqlens_host = self._host.tensors[turn]
            self.cu_seqlens_host.copy_(torch.tensor(
                [0, *itertools.accumulate(padded)], dtype=torch.int32))
            self.cu_seqlens.copy_(self.cu_seqlens_host, non_blocking=True)
            self._host.copied()
        else:  # a write into the next pinned buffer, no torch op but the copy
            self._write_offsets(lens)
        self.seq_lens, self.num_real_tokens = lens, total
        if derive:
            self.derive()
        self.backend.plan(self)
        return self

    def _write_offsets(self, lens: list[int]) -> None:
        """The offsets into the next host buffer, copied to the device."""
        turn = self._host.take()
        offsets = self._host.arrays[turn]
        ends = list(itertools.accumulate(lens, initial=0))  # 1 us; numpy's cumsum 2.5
        offsets[:len(ends)] = ends
        offsets[len(ends):] = ends[-1]  # sentinels: length 0, parked at the real count
        self.cu_seqlens_host = self._host.tensors[turn]
        self.cu_seqlens.copy_(self.cu_seqlens_host, non_blocking=True)
        self._host.copied()

    def derive(self) -> None:
        """Device side, graph-safe: the buffers computed from the device offsets (the
        validity of each row: ``row < cu_seqlens[-1]``)."""
        torch.lt(self._rows, self.cu_seqlens[-1:], out=self.valid)

    def last_token_rows(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The row of each slot's last token, computed on the device from the static
        offsets (no host copy, so no synchronisation): ``cu_seqlens[1:] - 1``, a
        zero-length slot pointing at a real row (row 0 at worst). int64 [num_slots];
        written into ``out`` when given (a static buffer the runner owns)."""
        rows = (self.cu_seqlens[1:] - 1).clamp_(min=0)
        if out is None:
            return rows.long()
        return out.copy_(rows)


def validate_seq_lens(seq_lens, num_tokens: int, num_slots: int) -> list[int]:
    """Lengths that fit a shape of ``num_tokens`` rows and ``num_slots`` request slots."""
    return check_lengths(seq_lens, tokens=num_tokens, slots=num_slots, error=OpInputError)


class AttentionBackend:
    """One way to run prefill attention; subclasses set the class attributes."""

    name = "base"
    devices: tuple[str, ...] = ("cpu", "cuda")
    requires: tuple[str, ...] = ()
    # Its forward reads only the metadata's static buffers, so it can be captured once and
    # replayed for every batch of a shape: under full capture, and inside breakable and
    # tc_piecewise graphs. False: it reads host values (an eager break or split op there).
    static_metadata = True
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)
    # The per-layer options of :mod:`.variant` it computes (window, softcap, sinks).
    options: frozenset[str] = frozenset()

    def check_dtype(self, dtype: torch.dtype) -> None:
        if dtype not in self.dtypes:
            names = ", ".join(str(d).removeprefix("torch.") for d in self.dtypes)
            raise OpInputError(f"attention backend {self.name!r} runs on {names}, not "
                               f"{str(dtype).removeprefix('torch.')}; pick another backend")

    def unavailable(self, device: torch.device | str, interpreted: bool = True) -> str | None:
        return unavailable(torch.device(device), self.devices, self.requires, interpreted)

    def runs_under(self, strategy: str) -> bool:
        """Whether it can run under ``strategy``: full capture needs static metadata."""
        return strategy != "full" or self.static_metadata

    def check_strategy(self, strategy: str) -> None:
        if not self.runs_under(strategy):
            raise UnsupportedStrategy(
                f"attention backend {self.name!r} cannot run under strategy {strategy!r}: "
                "it reads host lengths, which one graph per shape cannot hold. Use "
                "breakable or tc_piecewise (it runs there between graphs), or an attention "
                "backend with static metadata (torch_masked, triton, flashinfer, flash_attn)")

    def metadata(self, num_tokens: int, num_slots: int, device) -> AttentionMetadata:
        return AttentionMetadata(self, num_tokens, num_slots, device)

    def prepare(self, seq_lens, device, num_tokens: int | None = None) -> AttentionMetadata:
        """Metadata for one eager batch: T = sum(seq_lens) unless given, R = requests."""
        lens = check_lengths(seq_lens, error=OpInputError)
        meta = self.metadata(num_tokens or max(sum(lens), 1), len(lens), device)
        return meta.update(lens)

    def plan(self, meta: AttentionMetadata) -> None:
        """Backend-specific host planning after the common buffers are written."""

    def forward(self, q, k, v, out, meta: AttentionMetadata, scale: float,
                variant: Variant = PLAIN) -> None:
        """``out`` of the batch ``meta`` prepared; ``variant`` sets only options in
        ``options`` (the op refuses the others before the call)."""
        raise NotImplementedError


def zero_padding_rows(out: torch.Tensor, meta: AttentionMetadata) -> None:
    """Graph-safe: rows past the real tokens become zero (never NaN or stale)."""
    out.masked_fill_(~meta.valid[:, None, None], 0)


def guard_kv_reference(k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of k and v ``[T, Hk, D]`` in which padding rows (``valid`` false) are zero
    and a real value vector holding a NaN or an infinity is zeroed, its key set to NaN
    instead (see :func:`guard_kv`)."""
    pad = ~valid[:, None, None]
    bad = ~v.isfinite().all(dim=-1, keepdim=True) & ~pad
    k = k.masked_fill(pad, 0).masked_fill(bad, float("nan"))
    return k, v.masked_fill(pad | bad, 0)


def guard_kv(k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """k and v as attention kernels that read whole tiles must get them, so that no
    request sees another's values (nor padding's). Such kernels (FlashAttention-4,
    FlashInfer's fa3 path) load the K/V tile that holds a request's last rows whole, the
    next request's first rows with it, and mask those keys' scores to -inf: an assignment,
    so a NaN key is masked away, but the masked probability 0 still multiplies the loaded
    value, and 0 * NaN = NaN. So padding rows become zero, and a value vector that is not
    finite becomes zero while its key becomes NaN: the rows that may attend to it (its own
    request's) still come out NaN, the others never see it. One Triton kernel on CUDA."""
    if k.is_cuda:
        try:
            from graphcap.opsdb.triton.guard import guard_kv as kernel
        except ImportError:
            pass
        else:
            return kernel(k, v, meta.valid)
    return guard_kv_reference(k, v, meta.valid)
