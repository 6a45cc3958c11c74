"""The GPU window: its face for clients, its driver, and the steps it goes through."""
