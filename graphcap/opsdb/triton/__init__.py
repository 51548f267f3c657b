"""Triton kernels written in this project, one module per op family.

Each launcher takes tensors on the current CUDA device, launches on the current stream,
performs no host synchronisation (so it can be captured in a CUDA graph), and is tested
against :mod:`graphcap.opsdb.reference`. On CPU they run under ``TRITON_INTERPRET=1``.
"""
