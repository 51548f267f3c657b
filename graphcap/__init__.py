"""graphcap: CUDA graphs for LLM prefill and any launch-bound PyTorch forward.

Public names only; see docs/architecture.md for the layout.
"""

from graphcap import errors, opsdb
from graphcap.api import capture
from graphcap.breakable import eager_on_graph
from graphcap.config import CaptureConfig
from graphcap.core.graphs import GraphPool, new_pool
from graphcap.engine.accelerate import accelerate, restore
from graphcap.engine.generation import Generation, generate
from graphcap.engine.llm import LLM, Completion
from graphcap.errors import (
    CaptureError,
    GraphcapError,
    ModelChanged,
    ReplayError,
    UnsupportedModel,
    UnsupportedStrategy,
)
from graphcap.inputs.sampling import Sampling
from graphcap.opsdb import register_op
from graphcap.opsdb.attention.packed import packed

__version__ = "0.1.0"

__all__ = [
    "CaptureConfig",
    "CaptureError",
    "Completion",
    "GraphPool",
    "Generation",
    "GraphcapError",
    "LLM",
    "ModelChanged",
    "ReplayError",
    "Sampling",
    "UnsupportedModel",
    "UnsupportedStrategy",
    "accelerate",
    "capture",
    "eager_on_graph",
    "errors",
    "generate",
    "new_pool",
    "opsdb",
    "packed",
    "register_op",
    "restore",
]
