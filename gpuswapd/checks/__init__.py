"""Checks of a configuration before anything runs: compile caches, the known-bad table, boot checks."""
