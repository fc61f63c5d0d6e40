"""Ceiling division, the one helper for "how many blocks hold n tokens". It lives in kernels/,
the lowest layer that the scheduler, the worker and the kernels may all import."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for b > 0, exact for any size of integer; elementwise on integer numpy
    arrays too."""
    return -(-a // b)
