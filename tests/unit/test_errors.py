"""errors.py draws its tree in its docstring: the drawing must be the classes, with their codes."""

from __future__ import annotations

import inspect
import re

from gpuswapd import errors
from gpuswapd.errors import GpuswapError

LINE = re.compile(r"^(?P<indent>[ │├└─]*)(?P<name>[A-Z]\w+)\s+(?P<code>[a-z_]+)$")


def _drawn() -> dict[str, tuple[str | None, str]]:
    """Read the docstring's tree: class -> (its parent, its code)."""
    out: dict[str, tuple[str | None, str]] = {}
    stack: list[tuple[int, str]] = []
    for raw in (errors.__doc__ or "").splitlines():
        m = LINE.match(raw.strip("\n")[4:] if raw.startswith("    ") else "")
        if m is None:
            continue
        depth = len(m["indent"]) // 4
        while stack and stack[-1][0] >= depth:
            stack.pop()
        out[m["name"]] = (stack[-1][1] if stack else None, m["code"])
        stack.append((depth, m["name"]))
    return out


def _classes() -> dict[str, tuple[str | None, str]]:
    out: dict[str, tuple[str | None, str]] = {}
    for name, cls in inspect.getmembers(errors, inspect.isclass):
        if issubclass(cls, GpuswapError) and cls.__module__ == errors.__name__:
            parent = cls.__bases__[0].__name__ if cls is not GpuswapError else None
            out[name] = (parent, cls.code)
    return out


def test_the_docstring_draws_every_error_class_with_its_parent_and_code() -> None:
    drawn, classes = _drawn(), _classes()
    assert drawn, "no tree found in gpuswapd/errors.py's docstring"
    assert sorted(drawn) == sorted(classes), (f"drawn but no class: {sorted(set(drawn) - set(classes))}; "
                                              f"a class not drawn: {sorted(set(classes) - set(drawn))}")
    assert drawn == classes


def test_every_code_is_unique() -> None:
    codes = [code for _, code in _classes().values()]
    assert len(codes) == len(set(codes))
