"""python/kvroute/_native.pyi stays in sync with what the native module registers.

stubtest finds names missing on either side; it cannot see pybind11 signatures, so the
second test compares parameter names, kinds and defaults-present against the signature
pybind11 writes on the first line of each docstring.
"""

from __future__ import annotations

import ast
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest

STUB = Path(__file__).resolve().parents[1] / "python" / "kvroute" / "_native.pyi"


def _is_pybind11_metaclass_note(line: str) -> bool:
    """stubtest flags every pybind11 class: its metaclass is pybind11_type, not type.

    That metaclass is an implementation detail no stub should spell out, so this one
    error is accepted, and only for classes whose runtime metaclass really is pybind11's.
    """
    suffix = " is inconsistent, metaclass differs"
    if not line.startswith("kvroute._native.") or not line.endswith(suffix):
        return False
    native = pytest.importorskip("kvroute._native")
    obj = native
    for part in line[len("kvroute._native.") : -len(suffix)].split("."):
        obj = getattr(obj, part, None)
    return isinstance(obj, type) and type(obj).__name__ == "pybind11_type"


def test_stubtest_passes():
    env = dict(os.environ)
    # stubtest imports the package; its own warnings must not turn into errors here.
    env.pop("PYTHONWARNINGS", None)
    proc = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "kvroute._native", "--concise"],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    reported = [line for line in proc.stdout.splitlines() if line.strip()]
    # A failure with nothing reported (a crash) must not pass as "only metaclass notes".
    assert proc.returncode == 0 or reported, proc.stdout + proc.stderr
    errors = [line for line in reported if not _is_pybind11_metaclass_note(line)]
    assert not errors, "\n".join(errors)


def _split_top_level(text: str) -> list[str]:
    """Split a parameter list on the commas that are not inside brackets or quotes."""
    parts, depth, quote, current = [], 0, "", []
    for ch in text:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append("".join(current).strip())
            current = []
            continue
        current.append(ch)
    if "".join(current).strip():
        parts.append("".join(current).strip())
    return parts


def _runtime_params(name: str, doc: str | None) -> list[tuple[str, str, bool]] | None:
    """(name, kind, has default) per parameter from a pybind11 docstring; None if unknown."""
    if not doc:
        return None
    first = doc.splitlines()[0]
    if not first.startswith(name + "(") or "Overloaded function" in doc:
        return None
    inner, depth = [], 0
    for ch in first[len(name) :]:
        depth += ch == "("
        depth -= ch == ")"
        inner.append(ch)
        if depth == 0:
            break
    params, kind = [], "positional"
    for part in _split_top_level("".join(inner)[1:-1]):
        if part == "*":
            kind = "keyword"
        elif part == "/":
            params = [(n, "positional_only", d) for n, _, d in params]
        elif part.startswith("**"):
            params.append((part[2:].split(":")[0].strip(), "var_keyword", False))
        elif part.startswith("*"):
            params.append((part[1:].split(":")[0].strip(), "var_positional", False))
            kind = "keyword"
        else:
            params.append((part.split(":")[0].split("=")[0].strip(), kind, "=" in part))
    return params


def _stub_params(node: ast.FunctionDef) -> list[tuple[str, str, bool]]:
    args = node.args
    positional = args.posonlyargs + args.args
    first_default = len(positional) - len(args.defaults)
    out = [
        (a.arg, "positional_only" if i < len(args.posonlyargs) else "positional", i >= first_default)
        for i, a in enumerate(positional)
    ]
    if args.vararg:
        out.append((args.vararg.arg, "var_positional", False))
    out += [(a.arg, "keyword", d is not None) for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    if args.kwarg:
        out.append((args.kwarg.arg, "var_keyword", False))
    return out


def _stub_functions() -> dict[str, ast.FunctionDef]:
    """Qualified name -> definition, for module functions and methods of classes."""
    tree = ast.parse(STUB.read_text())
    found: dict[str, ast.FunctionDef] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            found[node.name] = node
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                overloaded = isinstance(item, ast.FunctionDef) and any(
                    isinstance(d, ast.Name) and d.id == "overload" for d in item.decorator_list
                )
                if isinstance(item, ast.FunctionDef) and not overloaded:
                    found[f"{node.name}.{item.name}"] = item
    return found


def test_stub_signatures_match_pybind11_docstrings():
    native = pytest.importorskip("kvroute._native")
    mismatches = []
    for qualname, node in _stub_functions().items():
        owner = native
        parts = qualname.split(".")
        for part in parts[:-1]:
            owner = getattr(owner, part, None)
        runtime = getattr(owner, parts[-1], None) if owner is not None else None
        if runtime is None or isinstance(inspect.getattr_static(owner, parts[-1]), property):
            continue  # a missing name is stubtest's to report; properties have no signature
        got = _runtime_params(parts[-1], getattr(runtime, "__doc__", None))
        if got is None:
            continue
        want = _stub_params(node)
        if got != want:
            mismatches.append(f"{qualname}: stub {want} != runtime {got}")
    assert not mismatches, "\n".join(mismatches)
