"""What the runner's messages tell a user to do."""

from __future__ import annotations

# What lets a batch that fell back replay instead, by the reason it fell back.
FIXES = {"padding": "add a smaller bucket (buckets=)",
         "too_many_tokens": "add a larger bucket (buckets= or max_tokens=; an Engine's "
                            "prefill_tokens, or chunked=True)",
         "too_many_requests": "capture more request slots (max_requests=, a "
                              "CachePrefillInputs' slots=; an Engine's max_batch)"}

# Added to the error of a capture again without a call's arguments (``recapture()``,
# ``capture_all()``) of a model of tensors, which runs it on the last capture's inputs'
# dtypes and shapes (a change seen at a call takes that call's).
AGAIN = ("graphcap: this capture ran the model on inputs of the dtypes and shapes of the "
         "last one; a model that takes others now (cast with .to(dtype)) is captured with "
         "runner.capture_all(example), example the arguments of a call")
