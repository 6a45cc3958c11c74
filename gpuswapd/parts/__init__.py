"""What a window moves: the engine, the resident, the VRAM."""
