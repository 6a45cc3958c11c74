"""The state on disk: the state document (``store``) and the writer that keeps it current."""

from gpuswapd.state.store import Document, StateStore
from gpuswapd.state.writer import StateWriter

__all__ = ["Document", "StateStore", "StateWriter"]
