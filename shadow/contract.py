"""The registry's contract: a mock exposes its real module's public API, with compatible signatures.

Public API: the names in the real module's `__all__` (or, without one, its public functions, classes
and upper-case constants defined in it). For each name the mock must have one of the same kind; for
functions and for every public method of a class, the mock's signature must accept every call the
real one accepts: each real parameter exists in the mock with the same name and kind (positional ones
in the same order), a parameter the real one makes optional is optional in the mock too, and anything
the mock adds has a default (or is *args / **kwargs). Constants must have the same value.
"""

from __future__ import annotations

import inspect
from types import ModuleType
from typing import Any, Callable


def public_names(module: ModuleType) -> list[str]:
    names = getattr(module, "__all__", None)
    if names is not None:
        return sorted(names)
    own = []
    for name, value in vars(module).items():
        if name.startswith("_") or inspect.ismodule(value):
            continue
        if (inspect.isfunction(value) or inspect.isclass(value)) and value.__module__ != module.__name__:
            continue  # imported, not defined here
        if inspect.isfunction(value) or inspect.isclass(value) or name.isupper():
            own.append(name)
    return sorted(own)


def signature_problems(where: str, real: Callable, mock: Callable) -> list[str]:
    """Why calls valid for `real` could fail on `mock` (empty when compatible)."""
    try:
        rs, ms = inspect.signature(real), inspect.signature(mock)
    except (TypeError, ValueError):
        return []  # builtins without a signature: nothing to compare
    problems = []
    rp, mp = dict(rs.parameters), dict(ms.parameters)
    var_kw = any(p.kind is p.VAR_KEYWORD for p in mp.values())
    positional = lambda ps: [p.name for p in ps.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    rpos, mpos = positional(rp), positional(mp)
    if mpos[:len(rpos)] != rpos:
        problems.append(f"{where}: positional parameters {rpos} of the real one are {mpos} in the mock")
    for name, p in rp.items():
        q = mp.get(name)
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            if not any(x.kind is p.kind for x in mp.values()):
                problems.append(f"{where}: the mock does not take {'*args' if p.kind is p.VAR_POSITIONAL else '**kwargs'}")
            continue
        if q is None:
            if not (p.kind is p.KEYWORD_ONLY and var_kw):
                problems.append(f"{where}: the mock has no parameter {name!r}")
            continue
        if q.kind is not p.kind and not (p.kind is p.KEYWORD_ONLY and q.kind is q.POSITIONAL_OR_KEYWORD):
            problems.append(f"{where}: parameter {name!r} is {p.kind.description} in the real one, "
                            f"{q.kind.description} in the mock")
        if p.default is not p.empty and q.default is q.empty:
            problems.append(f"{where}: parameter {name!r} is optional in the real one, required in the mock")
    for name, q in mp.items():
        if name not in rp and q.default is q.empty and q.kind not in (q.VAR_POSITIONAL, q.VAR_KEYWORD):
            problems.append(f"{where}: the mock requires extra parameter {name!r}")
    return problems


def _public_methods(cls: type) -> dict[str, Any]:
    out = {}
    for name in dir(cls):
        if name.startswith("_") and name != "__init__":
            continue
        value = inspect.getattr_static(cls, name)
        if isinstance(value, (staticmethod, classmethod)):
            out[name] = getattr(cls, name)
        elif inspect.isfunction(value) or isinstance(value, property):
            out[name] = value
    return out


def api_mismatches(real: ModuleType, mock: ModuleType) -> list[str]:
    """Every way `mock` fails to stand in for `real` (empty when it can)."""
    problems = []
    for name in public_names(real):
        if not hasattr(real, name):
            problems.append(f"{real.__name__}.__all__ names {name!r}, which it does not define")
            continue
        r = getattr(real, name)
        if not hasattr(mock, name):
            problems.append(f"{mock.__name__} lacks {name!r}")
            continue
        m = getattr(mock, name)
        where = f"{mock.__name__}.{name}"
        if inspect.isclass(r):
            if not inspect.isclass(m):
                problems.append(f"{where} is not a class")
                continue
            if issubclass(r, BaseException) and not (m is r or issubclass(m, r)):
                problems.append(f"{where} is not (a subclass of) the real exception, so `except` would miss it")
            mock_methods = _public_methods(m)
            for meth, rv in _public_methods(r).items():
                mv = mock_methods.get(meth)
                if mv is None:
                    problems.append(f"{where} lacks method {meth!r}")
                elif isinstance(rv, property) != isinstance(mv, property):
                    problems.append(f"{where}.{meth}: property in one, method in the other")
                elif not isinstance(rv, property):
                    problems += signature_problems(f"{where}.{meth}", rv, mv)
        elif callable(r):
            if not callable(m):
                problems.append(f"{where} is not callable")
            else:
                problems += signature_problems(where, r, m)
        elif r != m:
            problems.append(f"{where} = {m!r}, the real one is {r!r}")
    return problems
