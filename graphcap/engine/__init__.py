"""The top floor: :class:`LLM` (a model's graphs captured once, then generate and stream
calls on them), :func:`generate` (prompts to tokens over a paged cache, on runners
captured for the call) and its eager twins, :func:`~graphcap.engine.eager.prefill` and
:func:`~graphcap.engine.eager.decode_step`. Nothing in the package imports it but
``graphcap/__init__.py``, the CLI and the benchmarks."""

from graphcap.engine.arguments import DefaultsNotApplied
from graphcap.engine.eager import decode_step, prefill
from graphcap.engine.generation import Generation, generate
from graphcap.engine.llm import LLM, Completion, Delta

__all__ = ["LLM", "Completion", "DefaultsNotApplied", "Delta", "Generation", "decode_step",
           "generate", "prefill"]
