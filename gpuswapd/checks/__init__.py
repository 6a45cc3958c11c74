"""Checks of a configuration before anything runs.

An engine's compile caches (``caches``), the table of known-bad settings (``knownbad``), and what
is checked before an engine boots (``bootchecks``).
"""
