"""What a window moves.

The engine (a container, or a bare profile's none), the resident's units, the card's VRAM, and
what the resident's model files are.
"""

from gpuswapd.parts.engine import BareEngine, Engine
from gpuswapd.parts.resident import Resident
from gpuswapd.parts.vram import Vram

__all__ = ["BareEngine", "Engine", "Resident", "Vram"]
