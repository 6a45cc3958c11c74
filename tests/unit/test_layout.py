"""The package's layering, as pyproject.toml's import-linter contracts state it, and what may hold what.

Imports under TYPE_CHECKING count: a step that names the Window in a type depends on it.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("importlinter")

REPO = Path(__file__).resolve().parents[2]


def lint(root: Path) -> subprocess.CompletedProcess[str]:
    """Run lint-imports on the package under ``root`` with the repository's contracts."""
    return subprocess.run([sys.executable, "-c", "import sys; from importlinter.cli import lint_imports; "
                           "sys.exit(lint_imports(no_cache=True, no_logo=True))"],
                          cwd=root, env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=120)


def test_the_import_contracts_hold() -> None:
    out = lint(REPO)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout


def test_an_upward_import_under_type_checking_breaks_them(tmp_path: Path) -> None:
    shutil.copytree(REPO / "gpuswapd", tmp_path / "gpuswapd", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    closing = tmp_path / "gpuswapd" / "window" / "closing.py"
    text = closing.read_text()
    assert "if TYPE_CHECKING:\n" in text
    upward = "    from gpuswapd.window.window import Window  # noqa: F401\n"
    closing.write_text(text.replace("if TYPE_CHECKING:\n", "if TYPE_CHECKING:\n" + upward, 1))
    out = lint(tmp_path)
    assert out.returncode != 0, out.stdout[-4000:]
    assert "gpuswapd.window.closing -> gpuswapd.window.window" in out.stdout


PACKAGE = REPO / "gpuswapd"
# Where dict[str, Any] stays: what speaks JSON with the outside (the socket protocol, the CLI, the
# gateway's HTTP), the configuration's TOML input, and the adapters' JSON from outside; and the
# to_dict/from_dict methods that turn a typed value into a document and back.
WIRE_MODULES = ("protocol.py", "ctl/", "config.py", "adapters/", "gateway/")
WIRE_METHODS = frozenset({"to_dict", "from_dict"})
DICT_ANY_BOUND = 20


def _parsed(node: ast.AST) -> ast.AST:
    """Read a string annotation ("dict[str, Any]") as the expression it names."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        try:
            return ast.parse(node.value, mode="eval").body
        except (SyntaxError, ValueError):  # ValueError: a NUL in the string, on older Pythons (Debian 12's 3.11.2)
            return node
    return node


def _is_dict_any(node: ast.AST) -> bool:
    """Tell whether ``node`` is ``dict[str, Any]`` (or ``Dict[str, Any]``), written out or as a string."""
    node = _parsed(node)
    if not (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name)
            and node.value.id in ("dict", "Dict") and isinstance(node.slice, ast.Tuple)
            and len(node.slice.elts) == 2):
        return False
    key, value = node.slice.elts
    return isinstance(key, ast.Name) and key.id == "str" and isinstance(value, ast.Name) and value.id == "Any"


def _aliases(trees: dict[str, ast.Module]) -> set[str]:
    """Name the module-level aliases of dict[str, Any], anywhere in the package."""
    names = set()
    for tree in trees.values():
        for stmt in tree.body:
            if isinstance(stmt, ast.Assign) and _is_dict_any(stmt.value):
                names |= {t.id for t in stmt.targets if isinstance(t, ast.Name)}
            elif (isinstance(stmt, ast.AnnAssign) and stmt.value is not None and _is_dict_any(stmt.value)
                  and isinstance(stmt.target, ast.Name)):
                names.add(stmt.target.id)
    return names


def _annotations(node: ast.AST) -> list[ast.AST]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        args = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs, node.args.vararg, node.args.kwarg]
        return [_parsed(a.annotation) for a in args if a is not None and a.annotation is not None] + \
            ([_parsed(node.returns)] if node.returns is not None else [])
    if isinstance(node, ast.AnnAssign):
        return [_parsed(node.annotation)]
    return []


def dict_any_outside_wire_modules(sources: dict[str, str]) -> list[str]:
    """List where dict[str, Any] or an alias of it is written outside the wire modules (path:line).

    ``sources``: each module's text by its path in the package ("window/plan.py").
    """
    trees = {where: ast.parse(text, where) for where, text in sources.items()}
    aliases = _aliases(trees)
    found: list[str] = []

    def visit(node: ast.AST, where: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in WIRE_METHODS:
            return
        if _is_dict_any(node):  # anywhere: an annotation, an alias, a cast
            found.append(f"gpuswapd/{where}:{getattr(node, 'lineno', 0)}")
            return
        for annotation in _annotations(node):  # an alias's uses
            found.extend(f"gpuswapd/{where}:{n.lineno} ({n.id})" for n in ast.walk(annotation)
                         if isinstance(n, ast.Name) and n.id in aliases)
        for child in ast.iter_child_nodes(node):
            visit(child, where)

    for where, tree in trees.items():
        if not where.startswith(WIRE_MODULES):
            visit(tree, where)
    return found


def test_dict_any_outside_wire_modules_is_bounded() -> None:
    # The count itself: an alias and its uses, a string annotation and a cast count; to_dict,
    # from_dict and the wire modules do not.
    scratch = dict_any_outside_wire_modules({
        "a.py": 'Doc = dict[str, Any]\nx = cast(dict[str, Any], y)\n'
                'def f(d: Doc, e: "dict[str, Any]") -> list[Doc]: ...\n'
                'class C:\n    def to_dict(self) -> dict[str, Any]: ...\n',
        "b.py": "from a import Doc\nasync def g() -> Doc | None: ...\n",
        "ctl/main.py": "def h(d: dict[str, Any]) -> None: ...\n",
    })
    assert sorted(scratch) == ["gpuswapd/a.py:1", "gpuswapd/a.py:2", "gpuswapd/a.py:3", "gpuswapd/a.py:3 (Doc)",
                               "gpuswapd/a.py:3 (Doc)", "gpuswapd/b.py:2 (Doc)"], scratch
    found = dict_any_outside_wire_modules({p.relative_to(PACKAGE).as_posix(): p.read_text()
                                           for p in sorted(PACKAGE.rglob("*.py"))})
    assert len(found) <= DICT_ANY_BOUND, (
        f"{len(found)} dict[str, Any] outside the wire modules (at most {DICT_ANY_BOUND}): a value that "
        "crosses modules is a dataclass with to_dict/from_dict, a document only sent is a protocol.JsonObject:\n"
        + "\n".join(found))


TESTS = REPO / "tests"


def _is_test_module(dotted: str) -> bool:
    return dotted.rsplit(".", 1)[-1].startswith("test_")


def imports_of_test_modules(sources: dict[str, str]) -> list[str]:
    """List where a module imports a test module (path:line -> module), relative imports included.

    ``sources``: each module's text by its path under the repository ("tests/unit/test_x.py").
    """
    found: list[str] = []
    for where, text in sources.items():
        package = where.removesuffix(".py").split("/")[:-1]
        for node in ast.walk(ast.parse(text, where)):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # from .x import y, from . import test_y
                    base = ".".join([*package[:len(package) - node.level + 1], *([base] if base else [])])
                names = [base, *(f"{base}.{alias.name}" for alias in node.names)]
            else:
                continue
            found.extend(f"{where}:{node.lineno} -> {name}" for name in names if _is_test_module(name))
    return found


def test_no_test_module_imports_another() -> None:
    # What tests share lives in a conftest.py (or a helper module such as tests/fakes.py), under a
    # public name: a test module's helpers are its own to change, and a test function imported
    # into another module is collected and run there a second time.
    scratch = imports_of_test_modules({
        "tests/integration/test_a.py": "from tests.integration.test_window import metric\n"
                                       "import tests.unit.test_config\nfrom tests.integration.conftest import x\n",
        "tests/unit/server/test_b.py": "from .test_server import serve\nfrom . import test_watch, conftest\n"
                                       "from tests.unit import test_config as c\n",
    })
    assert scratch == [
        "tests/integration/test_a.py:1 -> tests.integration.test_window",
        "tests/integration/test_a.py:2 -> tests.unit.test_config",
        "tests/unit/server/test_b.py:1 -> tests.unit.server.test_server",
        "tests/unit/server/test_b.py:2 -> tests.unit.server.test_watch",
        "tests/unit/server/test_b.py:3 -> tests.unit.test_config",
    ], scratch
    found = imports_of_test_modules({p.relative_to(REPO).as_posix(): p.read_text()
                                     for p in sorted(TESTS.rglob("*.py"))})
    assert found == [], ("a test module imports another test module; move what it shares to that folder's "
                         "conftest.py (tests/integration/conftest.py, tests/unit/conftest.py):\n" + "\n".join(found))
