"""What a capture read of the model by address, and a cheap check that it still holds.

A graph reads the model's parameters and buffers where they were at capture: it does not
see a tensor assigned later (``m.w = Parameter(...)``, ``load_state_dict(...,
assign=True)``), nor a tensor whose storage moved (``m.to(dtype)``, ``p.data = ...``),
and the memory it reads may have been freed. :class:`ModelSnapshot` records, at capture,
every submodule, parameter and buffer slot of the model with the tensor it held and that
tensor's address; :meth:`~ModelSnapshot.current` says on the host whether they still
hold. Per call it compares the addresses (a C-level map of ``data_ptr``: 15-18 us for
qwen3-0.6b's 228 tensors on the H200's host at f89bd59) and the parameters' and buffers'
slots (``Module._apply`` replaces buffers in their dicts; ``lin.bias = None`` empties a
parameter's slot through no hook, about 10 us a call); the other slots change only
through ``nn.Module``'s registration (``setattr``, ``register_parameter``,
``load_state_dict(assign=True)``, a replaced submodule), whose global hooks count every
registration in the process, so they are compared again only after one, with the names
of every slot that holds one (a slot filled since: ``lin.bias = Parameter(...)``, a new
submodule). Containers (``ModuleList``, ``ModuleDict``, ``Sequential``,
``ParameterList``, ``ParameterDict``) write their dicts themselves (``insert``, ``pop``,
``del``, ``clear``): each call checks that each one still has the dict and the number of
entries it had (and, after a registration, their order). A slot of any other module
written directly (``module._parameters[name] = ...``, ``del module.weight``) bypasses
those hooks and is not seen, nor is a registration made inside torch.compiled code; nor
is a new view of the same memory (``p.data = p.data.t()``), whose address is unchanged.
In-place updates (``p.copy_(new)``, ``load_state_dict`` without ``assign``) keep every
slot and address, so replays see them, as eager does.

Forward hooks and pre-hooks (the modules' and the global ones) run in a graph as at its
capture: every hook registered anywhere takes a new ``RemovableHandle`` id, so after one
the model's hooks are compared again; the hook dicts that held one at capture are counted
on every call (a hook removed).

Autocast (on the model's kinds of device) and the model's ``training`` flag are compared
too. Other Python attributes (an ``eps``, a flag, a submodule's ``training`` set alone, a
plain tensor attribute that is no parameter or buffer) are baked into the graphs, as in
any CUDA graph: capture again after changing one. The plain tensor attributes held at
capture are held here, so that the graphs read them as they were, never freed memory."""

from __future__ import annotations

import operator

import torch
from torch import nn
from torch.nn.modules import module as _module
from torch.utils.hooks import RemovableHandle

from graphcap import compat
from graphcap.core.trees import repeats_memory
from graphcap.errors import UnsupportedModel

_PTR = torch.Tensor.data_ptr
_MODULE_DICTS = ("_parameters", "_buffers", "_modules")  # compared slot by slot
_PARAM_CONTAINERS = (nn.ParameterList, nn.ParameterDict)
_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential, *_PARAM_CONTAINERS)
_REGISTRATIONS = [0]  # registrations of a module, parameter or buffer anywhere, so far


def _count_registration(*_) -> None:
    # Not while Dynamo traces: it would guard on the count, and a forward that builds a
    # module (transformers' ``self.layers[:n]``) would recompile on every call.
    if torch.compiler.is_compiling():
        return
    _REGISTRATIONS[0] += 1


_HOOKED = compat.on_module_registrations(_count_registration)


def _slots(model: nn.Module):
    """(dict, key, qualified name) of every submodule, parameter and buffer slot."""
    modules, params, buffers = [], [], []
    for prefix, module in model.named_modules(remove_duplicate=True):
        dot = prefix + "." if prefix else ""
        modules += [(module._modules, name, dot + name) for name in module._modules]
        params += [(module._parameters, name, dot + name)
                   for name, t in module._parameters.items() if t is not None]
        buffers += [(module._buffers, name, dot + name)
                    for name, t in module._buffers.items() if t is not None]
    return modules, params, buffers


class _Containers:
    """Each container module's dict of entries and how many it held at capture."""

    def __init__(self, model: nn.Module):
        found = [(name, m) for name, m in model.named_modules(remove_duplicate=True)
                 if isinstance(m, _CONTAINERS)]
        self.names = [name or "the model" for name, _ in found]
        self.owners = [m for _, m in found]
        self.attrs = ["_parameters" if isinstance(m, _PARAM_CONTAINERS) else "_modules"
                      for m in self.owners]
        self.dicts = list(map(getattr, self.owners, self.attrs))
        self.sizes = list(map(len, self.dicts))
        self.orders = list(map(list, self.dicts))

    def same(self) -> bool:
        now = list(map(getattr, self.owners, self.attrs))
        return all(map(operator.is_, now, self.dicts)) and \
            list(map(len, now)) == self.sizes

    def same_order(self) -> bool:
        """Whether each container's entries are in the order they were (an entry popped
        and set again keeps the size; setting it is a registration)."""
        return list(map(list, self.dicts)) == self.orders

    def changes(self) -> list[str]:
        out = []
        for name, owner, attr, d, size, order in zip(
                self.names, self.owners, self.attrs, self.dicts, self.sizes, self.orders,
                strict=True):
            now = getattr(owner, attr)
            keys = list(now)
            if now is not d or len(keys) != size or keys != order:
                out.append(f"{name}: {type(owner).__name__} edited ({len(keys)} entries, "
                           f"{size} at capture{'' if keys == order else ', reordered'})")
        return out


def forward_hooks(model: nn.Module) -> dict[str, list]:
    """The ids of the forward hooks and pre-hooks each module of ``model`` runs (the global
    ones with the model's own, under ""): a graph runs its capture's, eager today's."""
    out = {name: [*m._forward_pre_hooks, *m._forward_hooks]
           for name, m in model.named_modules(remove_duplicate=False)}
    out[""] = [*out.get("", []), *_module._global_forward_pre_hooks,
               *_module._global_forward_hooks]
    return {name: ids for name, ids in out.items() if ids}


def _names(model: nn.Module) -> tuple[list[str], ...]:
    """The qualified names of every submodule, parameter and buffer slot that holds one."""
    return tuple([name for _, _, name in slots] for slots in _slots(model))


def _plain_tensors(model: nn.Module) -> list[torch.Tensor]:
    """Tensors a module holds as plain attributes, directly or in lists, tuples and dicts,
    nested (a cache of one ``(k, v)`` tuple per layer)."""
    out: list[torch.Tensor] = []
    for module in model.modules():
        for key, value in vars(module).items():
            if key not in _MODULE_DICTS:
                _tensors_in(value, out, set())
    return out


def _tensors_in(value, out: list, seen: set[int]) -> None:
    """Append the tensors in ``value`` and the lists, tuples and dicts it nests to ``out``
    (``seen``: the containers walked, so that one holding itself ends)."""
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif isinstance(value, list | tuple | dict) and id(value) not in seen:
        seen.add(id(value))
        for v in value.values() if isinstance(value, dict) else value:
            _tensors_in(v, out, seen)


def autocast_state(kinds: tuple[str, ...] = ("cpu", "cuda")) -> tuple:
    """The dtype autocast runs a forward in on each kind of device (None: off): the
    graphs compute in the dtypes of their capture, whatever a later call runs under."""
    return tuple(torch.get_autocast_dtype(d) if torch.is_autocast_enabled(d) else None
                 for d in kinds)


def held_tensors(model: nn.Module) -> list[torch.Tensor]:
    """Every tensor ``model`` holds: parameters, buffers and plain tensor attributes
    (in lists, tuples and dicts too, nested)."""
    return [*model.parameters(), *model.buffers(), *_plain_tensors(model)]


def ptrs_equal(tensors: list, ptrs: list[int]) -> bool:
    """Whether ``tensors[i].data_ptr() == ptrs[i]`` for every ``i`` (a C-level map)."""
    return list(map(_PTR, tensors)) == ptrs


def _describe(t) -> str:
    if t is None:
        return "removed"
    return f"{str(t.dtype).removeprefix('torch.')} {tuple(t.shape)} on {t.device}"


def _ptr(t) -> int:
    try:
        return _PTR(t)
    except (RuntimeError, TypeError, ValueError):  # no storage (a subclass, a lazy
        return -1  # module's uninitialised parameter): followed by identity alone


class _Slots:
    """Slots (a dict and a key each) and what each held at capture."""

    def __init__(self, slots):
        self.dicts = [d for d, _, _ in slots]
        self.keys = [k for _, k, _ in slots]
        self.names = [n for _, _, n in slots]
        self.held = [d[k] for d, k, _ in slots]

    def same(self) -> bool:
        return all(map(operator.is_, map(dict.get, self.dicts, self.keys), self.held))


class ModelSnapshot:
    """The model's submodules, parameters and buffers as a capture saw them.

    Held strongly: a tensor replaced after capture stays alive until the runner drops
    this snapshot (at its next capture), so its graphs never read freed memory."""

    def __init__(self, model: nn.Module):
        modules, params, buffers = _slots(model)
        self._modules, self._params, self._buffers = (
            _Slots(modules), _Slots(params), _Slots(buffers))
        self._names = (self._modules.names, self._params.names, self._buffers.names)
        self._containers = _Containers(model)
        tensors = self._params.held + self._buffers.held
        ptrs = [_ptr(t) for t in tensors]
        self._ptr_at_capture = {id(t): p for t, p in zip(tensors, ptrs, strict=True)}
        self._stored = [t for t, p in zip(tensors, ptrs, strict=True) if p >= 0]
        self._stored_ptrs = [p for p in ptrs if p >= 0]
        self._registrations = _REGISTRATIONS[0]
        self._frozen = _plain_tensors(model)  # what the graphs read, kept alive
        # Autocast of the kinds of device the model's tensors are on (both: none).
        self._kinds = tuple(sorted({t.device.type for t in tensors} & {"cpu", "cuda"})) \
            or ("cpu", "cuda")
        self._autocast, self._training = autocast_state(self._kinds), model.training
        # Every hook registered anywhere takes the next handle id: the hooks are compared
        # after one, and those of capture are counted on every call (one removed).
        self._hook_id, self._hooks = RemovableHandle.next_id, forward_hooks(model)
        self._hooked = [(d, len(d)) for m in model.modules()
                        for d in (m._forward_pre_hooks, m._forward_hooks) if d] + \
            [(d, len(d)) for d in (_module._global_forward_pre_hooks,
                                   _module._global_forward_hooks)]
        self.model = model

    def current(self) -> bool:
        """Whether every slot holds the tensor (or module) it held at capture, at the same
        address, and autocast and ``training`` as they were. Cheap enough for every call."""
        if autocast_state(self._kinds) != self._autocast or \
                self.model.training != self._training:
            return False
        if self._registrations != _REGISTRATIONS[0] or not _HOOKED:
            if not (self._modules.same() and self._containers.same_order()
                    and _names(self.model) == self._names):
                return False
            self._registrations = _REGISTRATIONS[0]  # a registration elsewhere
        if not (self._params.same() and self._buffers.same() and self._containers.same()):
            return False
        if RemovableHandle.next_id != self._hook_id or \
                not all(len(d) == n for d, n in self._hooked):
            if forward_hooks(self.model) != self._hooks:
                return False
            self._hook_id = RemovableHandle.next_id  # a hook elsewhere
        try:
            return ptrs_equal(self._stored, self._stored_ptrs)
        except (RuntimeError, TypeError, ValueError):  # a tensor that lost its storage
            return False

    def changes(self, limit: int = 5) -> list[str]:
        """What differs from capture, one line per slot (at most ``limit`` of them)."""
        out = self._containers.changes()
        if (now := autocast_state(self._kinds)) != self._autocast:
            out.append(f"autocast on {', '.join(self._kinds)}: {now} (None: off); at "
                       f"capture {self._autocast}")
        if self.model.training != self._training:
            out.append(f"training: {self.model.training} ({self._training} at capture: "
                       "model.train() or model.eval())")
        hooks = forward_hooks(self.model)
        for name in sorted(hooks.keys() | self._hooks.keys()):
            if hooks.get(name) != self._hooks.get(name):
                now, then = len(hooks.get(name, [])), len(self._hooks.get(name, []))
                whose = name or "the model's own and global"
                out.append(f"{whose} forward hooks and pre-hooks: {now} ({then} at capture; "
                           "the graphs run those of capture)")
        for now, then in zip(_names(self.model), map(set, self._names), strict=True):
            out += [f"{name}: added" for name in now if name not in then]
        for d, k, name, held in zip(self._modules.dicts, self._modules.keys,
                                    self._modules.names, self._modules.held, strict=True):
            now = d.get(k)
            if now is not held:
                out.append(f"{name}: " + ("removed" if now is None else
                                          f"another module ({type(now).__name__})"))
        for slots in (self._params, self._buffers):
            for d, k, name, held in zip(slots.dicts, slots.keys, slots.names, slots.held,
                                        strict=True):
                now = d.get(k)
                if now is None:
                    out.append(f"{name}: removed")
                elif now is not held:
                    out.append(f"{name}: another tensor ({_describe(now)}; was "
                               f"{_describe(held)})")
                elif _ptr(held) != self._ptr_at_capture[id(held)]:
                    out.append(f"{name}: its storage moved (now {_describe(now)}; the "
                               "graphs read the memory of capture)")
        more = len(out) - limit
        return out[:limit] + ([f"... and {more} more"] if more > 0 else [])

    def devices(self) -> set[torch.device]:
        """The devices the model's tensors are on now."""
        now = [d.get(k) for slots in (self._params, self._buffers)
               for d, k in zip(slots.dicts, slots.keys, strict=True)]
        return {t.device for t in now if t is not None}


def _held(model: nn.Module) -> list:
    """What every parameter and buffer slot holds, in one walk (half the time of
    naming them: 50 ms for 24k modules)."""
    return [t for m in model.modules() for d in (m._parameters, m._buffers)
            for t in d.values()]


def _named_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters(remove_duplicate=False)),
            **dict(model.named_buffers(remove_duplicate=False))}


_PERTURBABLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _same_value(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.shape == b.shape and a.dtype == b.dtype and a.device == b.device
            and torch.equal(a, b))


def settled(model: nn.Module, what: str, run, gather=None) -> tuple[object, int]:
    """``run()`` (an eager warm-up forward) and how many times it ran: once more where it
    replaced a parameter or buffer of ``model`` (made lazily: at the first call, for a new
    size). A forward that replaces one with another value on every call (``self.state =
    f(self.state)``) is refused: a graph reads the tensor each slot held as its capture
    began, so every replay would read that one, and assign nothing. One rebuilt alike on
    every call (a mask made from constants) is rebuilt inside the graph by every replay:
    captured. ``gather(key, what)`` (every rank's key): a split model's ranks run it again
    together where any rank must."""
    before = _held(model)
    out = run()
    after = _held(model)
    kept = len(after) == len(before) and all(map(operator.is_, after, before))
    if gather is not None:  # a rank running its forward once more alone would hang the rest
        kept = all(k == "kept" for k in gather("kept" if kept else "made a slot", what))
    if kept:
        return out, 1
    first = _named_tensors(model)
    out = run()
    second = _named_tensors(model)
    moving = [n for n, t in second.items() if n in first and t is not first[n]
              and not _same_value(t, first[n])]
    # Rebuilt alike: from constants, or from itself at a fixed point (every rank asks).
    rebuilt = {} if moving else {n: t for n, t in second.items() if n in first
                                 and t is not first[n] and t.is_floating_point()}
    following, runs = _from_itself(model, rebuilt, run, gather, what)
    if not moving and not following:
        return out, runs
    how = "run twice" if moving else "run again from other values of it"
    moving = moving or following
    raise UnsupportedModel(
        f"{type(model).__name__}'s forward gives {', '.join(moving[:5])} another value on "
        f"every call ({what}, {how}): a graph reads the tensor each slot held as its "
        "capture began, so every replay would read that one and assign nothing. Update "
        "such state in place (self.state.copy_(new)), or keep it outside the model and "
        "pass it in")


def _from_itself(model: nn.Module, rebuilt: dict, run, gather, what: str) -> tuple:
    """The slots among ``rebuilt`` (floating-point ones a forward replaced on both of two
    calls, with the same value: a warm-up's zero inputs are a fixed point of an average,
    ``self.ema * 0.5 + x.mean(0)``) whose new value follows what they held before, and
    the forward's runs in all (2 or more). Each is given another value (``2 t + 1``) and
    the forward runs again: one rebuilt from constants ignores it; one that follows it
    must keep it when rebuilt once more (a view of itself, a clone), else every replay
    would read the capture's tensor. Their values are put back after; a forward that
    fails on the values given is taken as it was (one of a split model raises)."""
    def together(needed: bool) -> bool:  # a split model's ranks run the forward together
        return needed if gather is None else "run" in gather("run" if needed else "-", what)

    rebuilt = {n: t for n, t in rebuilt.items() if t.dtype in _PERTURBABLE
               and not repeats_memory(t)}  # not one an in-place write refuses
    runs, moving, third = 2, [], {}
    if not together(bool(rebuilt)):
        return moving, runs
    values = {n: t.detach().clone() for n, t in rebuilt.items()}
    try:
        with torch.no_grad():
            for t in rebuilt.values():
                t.mul_(2).add_(1)
        runs += 1
        run()
        third = _named_tensors(model)
        followed = [n for n in rebuilt if n in third and not _same_value(third[n], values[n])]
        if together(bool(followed)):
            runs += 1
            run()
            now = _named_tensors(model)
            moving = [n for n in followed if n in now and not _same_value(now[n], third[n])]
    except Exception:
        if gather is not None:
            raise
    finally:
        now = _named_tensors(model)
        with torch.no_grad():
            for n, value in values.items():
                for t in (rebuilt[n], third.get(n), now.get(n)):
                    if t is not None and (t.shape, t.dtype) == (value.shape, value.dtype):
                        t.copy_(value)
    return moving, runs
