"""Ceiling division, on the floor: the scheduler, the worker and the kernels all import it."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Exact for any integer size, elementwise on numpy integer arrays too."""
    return -(-a // b)
