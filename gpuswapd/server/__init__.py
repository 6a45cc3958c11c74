"""The socket side: gpuswapd's Unix socket, who is asking, and what they may do."""
