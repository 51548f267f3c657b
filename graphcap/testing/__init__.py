"""Public testing helpers: property-test kernels against their references and captured
models against eager.

- :func:`check_op`: every available kernel of an op against its reference (plus opcheck).
- :func:`op_inputs`: the hypothesis strategy of an op's valid inputs.
- :func:`assert_replay_equivalent`: a model under each strategy equals eager, batch by
  batch and over call sequences.
- :func:`prefill_batches`: hypothesis batches of packed prefill requests;
  :func:`full_batch`: the one of them that packs the most; :func:`bucket_batches`: a most
  padded and a full batch of each bucket.
- a pytest plugin: the ``gpu`` marker and the ``graphcap_device`` fixture.
"""

from graphcap.testing.ops import check_op, default_tolerance
from graphcap.testing.replay import assert_replay_equivalent
from graphcap.testing.strategies import (
    bucket_batches,
    full_batch,
    op_inputs,
    prefill_batches,
)

__all__ = ["assert_replay_equivalent", "bucket_batches", "check_op", "default_tolerance",
           "full_batch", "op_inputs", "prefill_batches"]
