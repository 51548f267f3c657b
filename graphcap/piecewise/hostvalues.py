"""The Python numbers a captured piece bakes in as constants: a model's attribute (a
``scale``, an ``eps``) or a number the caller passes, which Dynamo passes the graph as an
argument once it has seen it change (automatic dynamic; a float under ``dynamic=True``
from the start). A replay would compute with the value of its capture, so where the
value now differs the piece is captured again with it (``recaptures``), once per change
whatever the sizes that see it. A value that keeps changing (a counter, a per-call
number) would be captured again on every call, so past :data:`CHANGES` changes a new
value runs eagerly (told once, naming the value and what to do) until it comes on two
calls in a row at a size, the second of which captures it (values that take turns, as
two kinds of call might pass, run eagerly, not captured again every other call)."""

from __future__ import annotations

# Changes of one value captured again before it runs eagerly (Dynamo's own recompile
# limit, for values it guards on).
CHANGES = 8


def same_value(a, b) -> bool:
    """Host values alike: equal, or both NaN (a NaN attribute is no change at each call)."""
    return bool(a == b) or (a != a and b != b)


class HostValues:
    """A piece's host values: how often each changed since the piece's first capture."""

    def __init__(self, names: dict[int, str]):
        self.names = names  # argument index -> the name the forward reads it under
        self.seen: dict[int, object] = {}  # argument -> its last new value
        self.changes: dict[int, int] = {}  # argument -> the times it changed
        self.eager: dict[int, tuple[int, object]] = {}  # size -> (argument, value) its
        # last call ran eagerly with (past the changes), until a replay of the size

    def changed(self, i: int, value, size: int) -> bool:
        """Argument ``i`` is ``value`` at a size whose capture baked another: count the
        change (once, whichever size sees it first); whether to capture the size again
        (within :data:`CHANGES` changes, or the size's last call ran eagerly with it)."""
        new = i not in self.seen or not same_value(self.seen[i], value)
        if new:
            self.seen[i] = value
            self.changes[i] = self.changes.get(i, 0) + 1
        last = self.eager.pop(size, None)
        if self.changes[i] <= CHANGES or (last is not None and last[0] == i
                                          and same_value(last[1], value)):
            return True
        self.eager[size] = (i, value)
        return False

    def replayed(self, size: int) -> None:
        """The size replayed its capture: a value its last call ran eagerly with did not
        come on the next call."""
        if self.eager:
            self.eager.pop(size, None)

    def why(self, i: int, static, args) -> str:
        name = self.names.get(i)
        what = f"host value {name}" if name else f"host value {i} of a piece"
        return (f"{what} is {args[i]!r} here, captured as {static[i]!r}, and changed "
                f"{self.changes[i]} times since capture: a graph bakes a Python number in "
                "as a constant, so each change was captured again; from now on a new value "
                "runs eagerly, and is captured once it comes on two calls in a row. Keep it "
                "fixed, or hold it in a tensor (a 0-d tensor attribute updated in place, "
                "which graphs read)")
