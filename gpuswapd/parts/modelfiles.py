"""Which model files a resident unit loads, read from its ExecStart= and Environment= (best effort).

llama.cpp's ``llama-server`` names its files with ``-m``/``--model``, ``--mmproj`` and
``-md``/``--model-draft``, or with the environment variables ``LLAMA_ARG_MODEL``,
``LLAMA_ARG_MMPROJ`` and ``LLAMA_ARG_MODEL_DRAFT``. Options count only after a ``llama-*``
program: ``python -m pkg`` names a module, not a model. A wrapper (``gpu_hold.py -- llama-server
...``, ``sh -c "exec llama-server ..."``) is read the same way: any argument of the command line
counts, and an argument holding a whole command line is split as a shell would. ``$VAR`` and
``${VAR}`` are taken from the unit's Environment=. What cannot be resolved to a path (``-hf``:
llama.cpp downloads the model into its own cache; a variable the unit does not set) is reported,
not guessed: ``[resident] files`` names such files.
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field

from gpuswapd.adapters.unitstates import Commands

MODEL_OPTIONS = frozenset({"-m", "--model", "--mmproj", "-md", "--model-draft"})
LLAMA_PROGRAM = "llama-"  # llama-server, llama-cli, llama-mtmd-cli …: the programs whose -m is a model file
MODEL_VARIABLES = ("LLAMA_ARG_MODEL", "LLAMA_ARG_MMPROJ", "LLAMA_ARG_MODEL_DRAFT")
# Downloaded by llama.cpp (Hugging Face, a URL) into its cache: no path to name.
DOWNLOAD_OPTIONS = frozenset({"-hf", "-hfr", "--hf-repo", "-hff", "--hf-file", "-hfd", "-hfrd", "--hf-repo-draft",
                              "-hfv", "-hfrv", "--hf-repo-v", "-mu", "--model-url"})
DOWNLOAD_VARIABLES = ("LLAMA_ARG_HF_REPO", "LLAMA_ARG_HF_FILE", "LLAMA_ARG_MODEL_URL")
_VARIABLE = re.compile(r"\$\{(\w+)\}|\$(\w+)")
_SPLIT = re.compile(r"^(?P<stem>.*)-(?P<part>\d{5})-of-(?P<parts>\d{5})\.gguf$")


@dataclass
class Found:
    """The model files a unit names, and what it names that is no file gpuswapd can find."""

    paths: list[str] = field(default_factory=list)
    unresolved: list[str] = field(default_factory=list)  # one line each: what, and why it was skipped


def model_files(cmds: Commands) -> Found:
    """Find the model files of one unit in its command lines and environment."""
    env = _environment(cmds.environment)
    found = Found()

    def take(what: str, value: str) -> None:
        path = _resolve(value, env, cmds.working_directory)
        if path is None:
            found.unresolved.append(f"{cmds.unit}: {what} {value!r}: cannot tell which file that is "
                                    "(a variable the unit does not set, or a path relative to a home directory)")
        elif path not in found.paths:
            found.paths.extend(p for p in split_parts(path) if p not in found.paths)

    for argv in cmds.argvs:
        words = _words(argv)
        server = False  # the options are llama.cpp's only after a llama-* program (not python's -m, say)
        for i, word in enumerate(words):
            if not word.startswith("-") and os.path.basename(word).startswith(LLAMA_PROGRAM):
                server = True
                continue
            if not server:
                continue
            option, eq, inline = word.partition("=")
            if option in MODEL_OPTIONS and word.startswith("--") and eq:
                take(option, inline)
            elif word in MODEL_OPTIONS and i + 1 < len(words):
                take(word, words[i + 1])
            elif option in DOWNLOAD_OPTIONS and (eq or i + 1 < len(words)):
                value = inline if eq else words[i + 1]
                found.unresolved.append(f"{cmds.unit}: {option} {value!r}: llama.cpp downloads that model into its "
                                        "own cache")
    for name in MODEL_VARIABLES:
        if name in env:
            take(f"Environment={name}", env[name])
    for name in DOWNLOAD_VARIABLES:
        if name in env:
            found.unresolved.append(f"{cmds.unit}: Environment={name}={env[name]!r}: llama.cpp downloads that "
                                    "model into its own cache")
    return found


def split_parts(path: str) -> list[str]:
    """Name every part of a split GGUF (``x-00001-of-00003.gguf``): llama.cpp loads them all."""
    m = _SPLIT.match(path)
    if m is None:
        return [path]
    parts = int(m["parts"])
    return [f"{m['stem']}-{n:05d}-of-{m['parts']}.gguf" for n in range(1, parts + 1)]


def _words(args: Sequence[str]) -> list[str]:
    """Return the arguments, each one that holds a command line (``sh -c "..."``) split as a shell would."""
    out: list[str] = []
    for arg in args:
        if any(c.isspace() for c in arg):
            try:
                out.extend(shlex.split(arg))
                continue
            except ValueError:
                pass  # unbalanced quotes: not a command line
        out.append(arg)
    return out


def _environment(assignments: Sequence[str]) -> dict[str, str]:
    env: dict[str, str] = {}
    for item in assignments:
        key, eq, value = item.partition("=")
        if eq:
            env[key] = value
    return env


def _resolve(value: str, env: dict[str, str], cwd: str) -> str | None:
    """Expand ``$VAR``/``${VAR}`` from the unit's environment; make it absolute; None if it cannot be."""
    missing = False

    def expand(m: re.Match[str]) -> str:
        nonlocal missing
        name = m.group(1) or m.group(2)
        if name not in env:
            missing = True
            return ""
        return env[name]

    text = _VARIABLE.sub(expand, value)
    if missing or not text:
        return None
    if not os.path.isabs(text):
        cwd = cwd.lstrip("!-") or "/"  # none set: a system service runs in /; "!" or "-": it may be missing
        if not os.path.isabs(cwd):  # "~": the home directory of User=, which is not known here
            return None
        text = os.path.join(cwd, text)
    return os.path.normpath(text)


SLOT_SAVE_OPTION = "--slot-save-path"


def slot_save_path(cmds: Commands) -> str | None:
    """Find llama-server's ``--slot-save-path DIR`` in a unit's command lines (a wrapper's too); None: none given.

    llama.cpp reads it from the command line only (it has no environment variable).
    """
    env = _environment(cmds.environment)
    for argv in cmds.argvs:
        words = _words(argv[1:])
        for i, word in enumerate(words):
            option, eq, inline = word.partition("=")
            if option != SLOT_SAVE_OPTION or (not eq and i + 1 >= len(words)):
                continue
            path = _resolve(inline if eq else words[i + 1], env, cmds.working_directory)
            if path is not None:
                return path
    return None
