"""The project's Triton varlen prefill kernel as an attention backend."""

from __future__ import annotations

from graphcap.opsdb.attention.base import AttentionBackend, AttentionMetadata
from graphcap.opsdb.attention.variant import OPTIONS, PLAIN, Variant
from graphcap.opsdb.spec import OpInputError

MAX_HEAD_DIM = 256  # the kernel's registers hold a row of q and its output


class TritonAttention(AttentionBackend):
    """Reads request offsets from the static ``cu_seqlens`` buffer; ``max_seqlen`` is the
    bucket size (a host int baked into the graph), so one capture serves every batch."""

    name = "triton"
    devices = ("cuda",)
    requires = ("triton",)
    options = frozenset(OPTIONS)

    def forward(self, q, k, v, out, meta: AttentionMetadata, scale: float,
                variant: Variant = PLAIN) -> None:
        from graphcap.opsdb.triton.attention import attention_varlen

        check_inputs(self.name, q, k, v, out)
        attention_varlen(q, k, v, out, meta.cu_seqlens, meta.num_tokens, scale, True,
                         variant.window, variant.softcap, variant.sinks)


def check_inputs(backend: str, q, k, v, out) -> None:
    """What the kernel takes beyond the op's check, refused as the op refuses (the
    launcher's own ValueError named neither the op nor what takes them)."""
    if q.shape[2] > MAX_HEAD_DIM:
        raise OpInputError(
            f"attention: backend {backend!r} takes head dims up to {MAX_HEAD_DIM}, not "
            f"{q.shape[2]}; pick another backend (torch_masked) for this model")
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out)):
        if t.numel() and t.stride(-1) != 1:
            raise OpInputError(
                f"attention: backend {backend!r} takes {name} contiguous in its last dim, "
                f"not strides {t.stride()}; call .contiguous() first")
