"""The project's Triton varlen prefill kernel as an attention backend."""

from __future__ import annotations

from graphcap.opsdb.attention.base import AttentionBackend, AttentionMetadata
from graphcap.opsdb.attention.variant import OPTIONS, PLAIN, Variant


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

        attention_varlen(q, k, v, out, meta.cu_seqlens, meta.num_tokens, scale, True,
                         variant.window, variant.softcap, variant.sinks)
