"""opsdb: the registry of custom ops graphcap's models and strategies are built from.

Importing it registers the built-in ops under the ``graphcap`` namespace
(``torch.ops.graphcap.rms_norm`` ...). See docs/ops.md to add your own.
"""

from graphcap.errors import BackendUnavailable, KernelUnavailable, OpInputError
from graphcap.opsdb import (  # noqa: F401
    activation,
    attention,
    cached,
    collective,
    decode,
    kv,
    linear,
    moe,
    norm,
    places,
    qkv,
    rotary,
    sample,
)
from graphcap.opsdb.spec import REGISTRY, Kernel, OpSpec, get_op, register_op

__all__ = [
    "REGISTRY",
    "BackendUnavailable",
    "Kernel",
    "KernelUnavailable",
    "OpInputError",
    "OpSpec",
    "get_op",
    "register_op",
]
