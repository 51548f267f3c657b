"""Dynamo's guards on graphcap's compiles: every tensor guarded, no diff guards where
cloning them leaks (torch 2.11), and none on the token count being 0 or 1 (one compile
serves every bucket: :func:`no_zero_one_specialisation`, :func:`contiguous`).

Where a module's parameter dict is unchanged (its keys and objects), Dynamo of torch 2.11
skips the tensor guards of its parameters (``skip_tensor_guards_with_matching_dict_tags``,
which torch 2.13 no longer reads). ``model.to(torch.float16)`` changes each parameter's
dtype in place (``param.data = ...``) and leaves the dict as it was, so the next call ran
the code traced at the old dtype (a ``dtype=h.dtype`` it baked: an attention output of the
old dtype). :func:`tensor_guards` turns the skip off for graphcap's compiles: a changed
dtype, device or shape compiles again.

Every compile Dynamo finishes clones the root of its guard tree into a "diff guard"
tree (the guards ``torch.compiler.set_stance(skip_guard_eval_unsafe=True)`` still
checks). Where ``RootGuardManager.clone_manager`` hands the clone to Python without
ownership (fixed upstream in pytorch/pytorch#184690), the clone is never freed: each
guard's code lines, stack and lambda, for the process's life (about 160 Python objects
for the compiles of one ``generate()`` call of the tiny reference decoder). graphcap
compiles once per runner, so a process making runners (every ``generate()`` call) grows
without bound.

:func:`graphcap_compile` marks graphcap's own compiles; where the probe finds the clone
leaks, their guard trees get no diff tree. Under the unsafe stance such a cache entry is
never picked (C++ treats a missing diff tree as a miss, as for an invalidated entry), so
graphcap refuses such a call with ``UnsupportedStrategy`` rather than let Dynamo raise
its own error: never a run of unchecked code. Other compiles of the process are left as
they are.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import gc
import weakref

import torch

from graphcap.errors import UnsupportedStrategy

_OURS: contextvars.ContextVar[bool] = contextvars.ContextVar("graphcap_compile",
                                                             default=False)


@functools.cache
def clone_leaks() -> bool | None:
    """Whether a cloned root guard manager outlives its last Python reference; None where
    this torch's guard API is not one the probe knows (nothing known to fix, and the
    tests say so)."""
    try:
        from torch._C._dynamo.guards import RootGuardManager
    except ImportError:
        return None

    class Held:
        pass

    held = Held()
    ref = weakref.ref(held)
    clone = None
    for extra in ((None,), ()):  # a user stack argument (newer torch), or none (older)
        try:
            root = RootGuardManager()
            root.add_lambda_guard(lambda _x, held=held: True, ["graphcap probe"], *extra)
            clone = root.clone_manager(lambda _node: True)
            break
        except (AttributeError, TypeError, RuntimeError):
            continue
    if clone is None:
        return None
    del root, clone, held
    gc.collect()
    return ref() is not None


@functools.cache
def _install() -> bool:
    if not clone_leaks():
        return False
    from torch._dynamo.guards import GuardManagerWrapper

    populate = getattr(GuardManagerWrapper, "populate_diff_guard_manager", None)
    if populate is None:
        return False

    @functools.wraps(populate)
    def populate_unless_ours(self) -> None:
        if not _OURS.get():
            return populate(self)
        self.diff_guard_root = None
        if self.cache_entry:  # a recompile: C++ reads the (missing) diff tree again
            self.cache_entry.update_diff_guard_root_manager()

    GuardManagerWrapper.populate_diff_guard_manager = populate_unless_ours
    return True


def _unsafe_stance() -> bool:
    from torch._dynamo import eval_frame

    check = getattr(eval_frame, "_is_skip_guard_eval_unsafe_stance", None)
    return bool(check is not None and check())


def graphcap_compile(context: contextvars.Context) -> contextvars.Context:
    """Mark the compiles that run in ``context`` (a copy of the caller's) as graphcap's;
    returns ``context``. Where their guard trees go without a diff tree, a call under the
    unsafe stance is refused (``UnsupportedStrategy``): Dynamo would raise its own error."""
    if _install() and _unsafe_stance():
        raise UnsupportedStrategy(
            "strategy='tc_piecewise' cannot run under torch.compiler.set_stance("
            "skip_guard_eval_unsafe=True) on this torch: its compiles keep no diff guards, "
            "which this torch never frees (pytorch/pytorch#184690). Call it outside that "
            "stance, or use strategy='full' or 'breakable'")
    context.run(_OURS.set, True)
    return context


def tensor_guards():
    """A context in which Dynamo guards every tensor of a compile, parameters whose dict
    is unchanged too (the module docstring); nothing where this torch has no such skip."""
    config = torch._dynamo.config
    if not hasattr(config, "skip_tensor_guards_with_matching_dict_tags"):
        return contextlib.nullcontext()
    return config.patch(skip_tensor_guards_with_matching_dict_tags=False)


# Appended to the compile cache's key tag by no_zero_one_specialisation.
CACHE_TAG = "+graphcap-size-oblivious"


def no_zero_one_specialisation():
    """A context in which the dynamic sizes of a compile are not specialised on 0 and 1
    (``torch.fx.experimental._config.backed_size_oblivious``, size-oblivious reasoning
    for backed sizes): a forward traced at 8 tokens serves 1 token under the same code,
    where Dynamo would otherwise guard ``2 <= tokens`` and compile the forward again at
    the first one-token call (a decode step of one request). A branch of the forward's
    own on a size still guards, and compiles again where it goes the other way; nothing
    where this torch has no such option.

    The option is not part of Inductor's and AOT autograd's cache keys: an entry saved by a
    compile without it (a user's own ``torch.compile(backend="sgl_piecewise")``, an older
    graphcap) carries its guard ``2 <= tokens``, and a hit on it compiled the pieces again
    at one token. Inside the context the key's tag (``torch.compiler.config.cache_key_tag``,
    where this torch has it) gets :data:`CACHE_TAG` appended, so such compiles keep
    entries of their own."""
    from torch.fx.experimental import _config as config

    if not hasattr(config, "backed_size_oblivious"):
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(config.patch(backed_size_oblivious=True))
    keys = getattr(torch.compiler, "config", None)
    if hasattr(keys, "cache_key_tag"):
        stack.enter_context(keys.patch(cache_key_tag=keys.cache_key_tag + CACHE_TAG))
    return stack


def contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t.contiguous()`` inside a compile, without a guard on its sizes: ``t`` itself where
    its strides are static and contiguous (a dynamic token count as its first dim), else
    a contiguous copy. (``contiguous()`` asks whether the view already is, which Dynamo
    answers for a dynamic token count T with a guard on T != 1, and compiles again at 1
    token.) The strides are compared as plain ints only, inner dims first: the first dim's
    size is never read."""
    expected = 1
    for size, stride in reversed(tuple(zip(t.shape, t.stride(), strict=True))):
        if type(stride) is not int or type(expected) is not int or stride != expected:
            return t.clone(memory_format=torch.contiguous_format)
        expected = expected * size
    return t
