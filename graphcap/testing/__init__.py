"""Public testing helpers: property-test kernels against their references."""

from graphcap.testing.ops import check_op, default_tolerance

__all__ = ["check_op", "default_tolerance"]
