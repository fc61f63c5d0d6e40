"""Ceiling division, in kernels/: the lowest layer the scheduler, worker and kernels all import."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Exact for any integer size, elementwise on numpy integer arrays too."""
    return -(-a // b)
