"""GPU benchmarks: ``graphcap bench ops`` (kernels against FlashInfer and FlashAttention)."""
