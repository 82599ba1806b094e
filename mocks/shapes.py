"""ShapeOnly: a bulk buffer with a size and no bytes, the currency of shape-only emulation.

Defined here, below both users: the emulated network (harness.engine.net) moves it as a modeled
transfer of its size, and shape-only compute (mocks.compute) hands gradient slices of it to the real
FTAR engine. harness.engine re-exports it.
"""

from __future__ import annotations

__all__ = ["ShapeOnly"]


class ShapeOnly:
    """A bulk buffer that has a size but no bytes: `send_bytes(ShapeOnly(n))` models an n-byte
    transfer; `recv_into(ShapeOnly(n))` accepts an n-byte frame without copying. A real buffer that
    receives a shape-only frame is left as it was."""

    __slots__ = ("nbytes",)

    def __init__(self, nbytes: int) -> None:
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        self.nbytes = int(nbytes)

    def __len__(self) -> int:
        return self.nbytes

    def __repr__(self) -> str:
        return f"ShapeOnly({self.nbytes})"
