"""The table of known-bad engine settings: configurations known to crash the engine.

The table ships inside the package (``gpuswapd/data/known-bad.toml``); a distribution may install
a copy as ``/usr/share/gpuswapd/known-bad.toml``, which is then read instead. Operators add rows in
``/etc/gpuswapd/known-bad.d/*.toml`` (read in name order; a row there with a shipped row's id
replaces it). ``$GPUSWAPD_KNOWN_BAD`` names another shipped table and ``$GPUSWAPD_KNOWN_BAD_DIR``
another directory of rows (tests, or a second tree of instances).

A row matches an engine's image (a glob), its environment and its command line (conditions such
as ``"> 7"``) and its maximum context (``--max-model-len``, else ``MAX_MODEL_LEN``). Every row is
validated strictly: a malformed file is a ConfigError (exit 78) that names the file and the key.
This module reads only the standard library and ``gpuswapd.errors``, so that any install can load
its table.
"""

from __future__ import annotations

import fnmatch
import importlib.resources
import math
import operator
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuswapd.errors import ConfigError

if sys.version_info >= (3, 11):  # noqa: UP036 - tomli stays the fallback the package declares
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

SHIPPED_ENV = "GPUSWAPD_KNOWN_BAD"
DIR_ENV = "GPUSWAPD_KNOWN_BAD_DIR"
SHIPPED = Path("/usr/share/gpuswapd/known-bad.toml")
OPERATOR_DIR = Path("/etc/gpuswapd/known-bad.d")
PACKAGE_DATA = "data/known-bad.toml"

_ID = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_OPTION = re.compile(r"^--?[A-Za-z0-9][A-Za-z0-9_.-]*$")
_COMPARISON = re.compile(r"^\s*(>=|<=|==|!=|>|<)\s*(\S+)\s*$")
_OPS: dict[str, Callable[[float, float], bool]] = {
    ">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le, "==": operator.eq,
    "!=": operator.ne,
}
_ROW_KEYS = ("id", "image", "env", "args", "context", "reason", "source", "refuse")
# vLLM reads --max-model-len as a human-readable integer: "32k" is 32000, "32K" is 32768.
_HUMAN = re.compile(r"^(\d+(?:\.\d+)?)([kmgKMG]?)$")
_SCALE = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}
CONTEXT_OPTION = "--max-model-len"
CONTEXT_ENV = "MAX_MODEL_LEN"


@dataclass(frozen=True)
class Condition:
    """What a value must be: a comparison with a number, set or not set, or a glob."""

    text: str                 # as the row wrote it, for messages
    op: str | None = None     # a comparison ...
    number: float = 0.0       # ... with this number
    present: bool | None = None  # True: set (to anything); False: not set
    glob: str | None = None

    def holds(self, value: str | None, number: Callable[[str], float | None]) -> bool:
        """Tell whether ``value`` (None: not set) meets this condition."""
        if self.present is not None:
            return (value is not None) is self.present
        if value is None:
            return False
        if self.op is not None:
            got = number(value)
            return got is not None and _OPS[self.op](got, self.number)
        return fnmatch.fnmatchcase(value, self.glob or "")

    @property
    def lower_bound(self) -> bool:
        """Tell whether large values meet it (what an unknown context most likely is)."""
        return self.op in (">", ">=")


@dataclass(frozen=True)
class Row:
    """One known-bad configuration: what it matches, why it is bad, and whether it refuses."""

    id: str
    reason: str
    source: str
    refuse: bool
    file: str
    image: str | None = None
    env: Mapping[str, Condition] = field(default_factory=dict)
    args: Mapping[str, Condition] = field(default_factory=dict)
    context: Condition | None = None


@dataclass(frozen=True)
class Match:
    """A row that an engine's settings meet; ``certain`` is False when its context is not known."""

    row: Row
    certain: bool
    matched: tuple[str, ...]  # what met each condition, e.g. "DFLASH_TOKENS=15"

    def detail(self) -> str:
        """Say what matched, in one phrase."""
        return ", ".join(self.matched)


@dataclass(frozen=True)
class Table:
    """The rows in effect, and the files they came from."""

    rows: tuple[Row, ...] = ()
    files: tuple[str, ...] = ()

    @property
    def ids(self) -> list[str]:
        """List the row ids, in table order."""
        return [r.id for r in self.rows]

    def matches(self, image: str, env: Mapping[str, str], argv: Sequence[str]) -> list[Match]:
        """Return every row that an engine with this image, environment and command line meets."""
        found = (match(row, image, env, argv) for row in self.rows)
        return [m for m in found if m is not None]


def match(row: Row, image: str, env: Mapping[str, str], argv: Sequence[str]) -> Match | None:
    """Return how ``row`` matches these settings, or None if one of its conditions does not hold."""
    matched: list[str] = []
    if row.image is not None:
        if not fnmatch.fnmatchcase(image, row.image):
            return None
        matched.append(f"image {image}")
    for name, cond in row.env.items():
        value = env.get(name)
        if not cond.holds(value, _float):
            return None
        matched.append(f"{name}={value}" if value is not None else f"{name} not set")
    for option, cond in row.args.items():
        found, value = arg_value(argv, option)
        shown: str | None = (value if value is not None else "") if found else None
        if not cond.holds(shown, _float):
            return None
        matched.append(f"{option} {value}" if value is not None else option if found else f"no {option}")
    certain = True
    if row.context is not None:
        context, where = max_context(env, argv)
        if context is None:
            if not row.context.lower_bound:
                return None
            # vLLM then takes the model's own maximum, which is nearly always far above a bound that matters.
            certain = False
            matched.append(f"context not set ({where}: vLLM takes the model's own maximum)")
        elif _OPS[row.context.op or "=="](float(context), row.context.number):
            matched.append(f"context {context} ({where})")
        else:
            return None
    return Match(row, certain, tuple(matched))


def arg_value(argv: Sequence[str], option: str) -> tuple[bool, str | None]:
    """Find ``option`` on a command line (``--opt VALUE`` or ``--opt=VALUE``; the last one counts).

    Return whether it is there and its value (None for a flag without one). Like vLLM's parser,
    ``--max_model_len`` is ``--max-model-len``.
    """
    want = _option_name(option)
    found, value = False, None
    for i, token in enumerate(argv):
        name, eq, rest = token.partition("=")
        if not name.startswith("-") or _option_name(name) != want:
            continue
        found = True
        if eq:
            value = rest
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            value = argv[i + 1]
        else:
            value = None
    return found, value


def max_context(env: Mapping[str, str], argv: Sequence[str]) -> tuple[int | None, str]:
    """Return the engine's maximum context (None if not set or unreadable) and where it was read."""
    found, raw = arg_value(argv, CONTEXT_OPTION)
    where = CONTEXT_OPTION
    if not found or raw is None:
        raw, where = env.get(CONTEXT_ENV), CONTEXT_ENV
    if raw is None:
        return None, f"no {CONTEXT_OPTION} or {CONTEXT_ENV}"
    value = human_int(raw)
    return value, where if value is not None else f"{where}={raw!r}, not a number"


def human_int(text: str) -> int | None:
    """Read an integer as vLLM does: "32768", "32k" (32000), "32K" (32768), "1.5m"; None if it is none."""
    m = _HUMAN.match(text.strip())
    if not m:
        return None
    return int(float(m.group(1)) * _SCALE[m.group(2)])


def _option_name(name: str) -> str:
    dashes = len(name) - len(name.lstrip("-"))
    return name[:dashes] + name[dashes:].replace("_", "-")


def _float(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


# -- reading the table --------------------------------------------------------------------------


def shipped_source() -> tuple[str, str]:
    """Return the shipped table's name and text: $GPUSWAPD_KNOWN_BAD, else /usr/share's, else the package's."""
    named = os.environ.get(SHIPPED_ENV)
    if named:
        return named, _read(Path(named), f"the known-bad table {named} (${SHIPPED_ENV})")
    if SHIPPED.exists():
        return str(SHIPPED), _read(SHIPPED, f"the known-bad table {SHIPPED}")
    data = importlib.resources.files("gpuswapd").joinpath(PACKAGE_DATA)
    try:
        return str(data), data.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"the known-bad table shipped with gpuswapd ({data}) cannot be read: {err}; "
                          "reinstall gpuswapd") from None


def operator_dir() -> Path:
    """Return the directory of the operator's rows ($GPUSWAPD_KNOWN_BAD_DIR, else /etc/gpuswapd/known-bad.d)."""
    return Path(os.environ.get(DIR_ENV) or OPERATOR_DIR)


def load_table(shipped: tuple[str, str] | None = None, directory: Path | None = None) -> Table:
    """Read the shipped table, then the operator's rows; a malformed file is a ConfigError naming it."""
    name, text = shipped if shipped is not None else shipped_source()
    rows = {r.id: r for r in parse_rows(text, name)}
    files = [name]
    mine: dict[str, Row] = {}
    for path in _row_files(directory if directory is not None else operator_dir()):
        for row in parse_rows(_read(path, f"the known-bad rows {path}"), str(path)):
            if row.id in mine:
                raise ConfigError(f"{path}: row id {row.id!r} is also a row of {mine[row.id].file}: "
                                  "give each of the operator's rows its own id")
            mine[row.id] = row
            rows[row.id] = row  # the operator's row replaces a shipped one of the same id
        files.append(str(path))
    return Table(tuple(rows.values()), tuple(files))


def _row_files(directory: Path) -> list[Path]:
    if not directory.exists():
        return []
    if not directory.is_dir():
        raise ConfigError(f"{directory}: not a directory (the operator's known-bad rows: *.toml files in it)")
    try:
        return sorted(p for p in directory.iterdir() if p.name.endswith(".toml") and not p.name.startswith("."))
    except OSError as err:
        raise ConfigError(f"{directory}: cannot list the operator's known-bad rows: {err}") from None


def _read(path: Path, what: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: cannot read {what}: {err}") from None


def parse_rows(text: str, source: str) -> list[Row]:
    """Parse and validate one file of rows (``[[row]]`` tables); ConfigError names the file and the key."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{source}: not valid TOML: {err}") from None
    extra = sorted(set(data) - {"row"})
    if extra:
        raise ConfigError(f"{source}: {extra[0]}: unknown key (a known-bad file holds only [[row]] tables)")
    tables = data.get("row", [])
    if not isinstance(tables, list):
        raise ConfigError(f"{source}: row: expected [[row]] tables, got {type(tables).__name__}")
    rows: list[Row] = []
    for i, table in enumerate(tables):
        row = _row(table, source, f"row[{i}]")
        if any(r.id == row.id for r in rows):
            raise ConfigError(f"{source}: row[{i}].id: {row.id!r} is the id of an earlier row in this file")
        rows.append(row)
    return rows


def _row(table: Any, source: str, where: str) -> Row:
    def fail(key: str, why: str) -> ConfigError:
        return ConfigError(f"{source}: {where}.{key}: {why}" if key else f"{source}: {where}: {why}")

    if not isinstance(table, dict):
        raise fail("", f"expected a table, got {type(table).__name__}")
    for key in table:
        if key not in _ROW_KEYS:
            raise fail(key, f"unknown key (a row knows: {', '.join(_ROW_KEYS)})")
    for key in ("id", "reason", "source", "refuse"):
        if key not in table:
            raise fail(key, "missing (every row has id, reason, source and refuse)")
    row_id = table["id"]
    if not isinstance(row_id, str) or not _ID.match(row_id):
        raise fail("id", f"{row_id!r} is not a row id (lowercase letters, digits, '.', '_' and '-', at most 64)")
    where = f"{where} ({row_id})"
    for key in ("reason", "source"):
        if not isinstance(table[key], str) or not table[key].strip():
            raise fail(key, "expected a string that says it, not empty")
    if not isinstance(table["refuse"], bool):
        raise fail("refuse", f"expected true or false, got {table['refuse']!r}")
    image = table.get("image")
    if image is not None and (not isinstance(image, str) or not image.strip()):
        raise fail("image", f"expected a glob on the image name such as \"vllm/vllm-openai:*\", got {image!r}")
    env = _conditions(table.get("env", {}), _ENV_NAME, "an environment variable name", fail, "env")
    args = _conditions(table.get("args", {}), _OPTION, "a command-line option such as \"--max-num-seqs\"", fail,
                       "args")
    context = None
    if "context" in table:
        context = _condition(table["context"], fail, "context")
        if context.op is None:
            raise fail("context", f"{context.text!r}: the context takes a comparison such as \">= 20000\"")
    if image is None and not env and not args and context is None:
        raise fail("", "matches every engine: give it at least one of image, env, args, context")
    return Row(id=row_id, reason=table["reason"].strip(), source=table["source"].strip(), refuse=table["refuse"],
               file=source, image=image, env=env, args=args, context=context)


def _conditions(value: Any, names: re.Pattern[str], what: str, fail: Callable[[str, str], ConfigError],
                key: str) -> dict[str, Condition]:
    if not isinstance(value, dict):
        raise fail(key, f"expected a table such as {{ NAME = \"> 7\" }}, got {type(value).__name__}")
    out: dict[str, Condition] = {}
    for name, raw in value.items():
        if not names.match(name):
            raise fail(f"{key}.{name}", f"not {what}")
        out[name] = _condition(raw, fail, f"{key}.{name}")
    return out


def _condition(raw: Any, fail: Callable[[str, str], ConfigError], key: str) -> Condition:
    if isinstance(raw, bool):
        return Condition("set" if raw else "not set", present=raw)
    if not isinstance(raw, str):
        raise fail(key, f"{raw!r} is not a condition: write \"> 7\", \">= 20000\", \"== 1\", true (set), false "
                   "(not set), or a glob such as \"dflash*\"")
    if not raw.strip():
        raise fail(key, "an empty condition: write \"> 7\", true (set), false (not set) or a glob such as \"dflash*\"")
    m = _COMPARISON.match(raw)
    if m:
        number = _float(m.group(2))
        if number is None or not math.isfinite(number):
            raise fail(key, f"{raw!r}: {m.group(2)!r} is not a number")
        return Condition(raw.strip(), op=m.group(1), number=number)
    if raw.lstrip()[:1] in "<>=!":
        raise fail(key, f"{raw!r} is not a comparison: write it as \"> 7\", \">= 20000\", \"== 1\" or \"!= 0\"")
    return Condition(raw, glob=raw)
