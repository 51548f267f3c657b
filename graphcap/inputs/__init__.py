"""The kinds of input a runner takes, one file each, behind the seam of
:mod:`graphcap.core.inputs` (:class:`~graphcap.core.inputs.Inputs`): tensors along dim 0
(:class:`TensorInputs`), packed prefill requests (:class:`PrefillInputs`), decode steps
over a paged cache (:class:`DecodeInputs`), prefill and extend into it
(:class:`CachePrefillInputs`), both the one paged kind (:class:`PagedInputs`: tokens of
requests at positions over the cache, ``tokens_per_request`` 1, ``1 + k`` or any); and
what a step draws its tokens with (:class:`Sampling`)."""

from graphcap.inputs.cache_prefill import CachePrefillInputs
from graphcap.inputs.decode import DecodeInputs
from graphcap.inputs.paged import PagedInputs
from graphcap.inputs.prefill import PrefillInputs
from graphcap.inputs.sampling import Sampling
from graphcap.inputs.tensors import TensorInputs

__all__ = ["CachePrefillInputs", "DecodeInputs", "PagedInputs", "PrefillInputs", "Sampling",
           "TensorInputs"]
