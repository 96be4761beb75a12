"""Typed, strict loading of ``params.yaml`` into frozen dataclasses.

``params.yaml`` holds a ``base`` section (``seed``, ``profile``), one section per stage
(the section name is the stage name), and a ``profiles`` mapping: each profile has one
entry per stage section holding the keys it overrides (``{}`` for none). The active
profile is ``base.profile``; DVC tracks it together with ``profiles.<profile>.<stage>``
(see dvc.yaml), so a cached output always matches the params DVC recorded for it.

:func:`load_params` builds a stage's frozen ``Params`` dataclass from its section with
the active profile's overrides applied. A field named ``seed`` that the section does not
set is filled from ``base.seed``. Unknown or mistyped keys fail before any work with a
:class:`ParamsError` naming the file, section, key, expected type and nearest valid key.

Check every section from the shell with ``mars params check``.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin

import yaml

T = TypeVar("T")


class ParamsError(ValueError):
    """A params.yaml problem, with a message that says what, where and how to fix it."""


@dataclass(frozen=True)
class BaseParams:
    """The ``base`` section: shared by every stage."""

    seed: int = 0
    profile: str = "default"


def read_params_file(path: str | Path) -> dict[str, Any]:
    """Read params.yaml into a dict, failing clearly on a missing or malformed file."""
    path = Path(path)
    if not path.is_file():
        raise ParamsError(f"{path}: params file not found (run from the repository root or pass --params)")
    try:
        doc = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ParamsError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(doc, dict):
        raise ParamsError(f"{path}: top level must be a mapping of sections, got {type(doc).__name__}")
    return doc


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in get_args(tp))
    if origin in (list, tuple, dict):
        args = ", ".join(_type_name(a) for a in get_args(tp) if a is not Ellipsis)
        return f"{origin.__name__}[{args}]"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Return ``value`` checked against ``tp`` (ints accepted for floats, lists for tuples)."""
    origin = get_origin(tp)
    bad = ParamsError(f"{where}: expected {_type_name(tp)}, found {type(value).__name__} ({value!r})")
    if tp is Any:
        return value
    if origin is Literal:
        if value not in get_args(tp):
            raise bad
        return value
    if origin in (Union, types.UnionType):
        for arg in get_args(tp):
            try:
                return _coerce(value, arg, where)
            except ParamsError:
                continue
        raise bad
    if tp is type(None):
        if value is not None:
            raise bad
        return None
    if tp is bool:
        if not isinstance(value, bool):
            raise bad
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise bad
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise bad
        args = get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                raise ParamsError(f"{where}: expected {len(args)} items ({_type_name(tp)}), found {len(value)}")
            items = [_coerce(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(value, args))]
        else:
            item_tp = args[0] if args else Any
            items = [_coerce(v, item_tp, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise bad
        k_tp, v_tp = get_args(tp) or (Any, Any)
        return {_coerce(k, k_tp, where): _coerce(v, v_tp, f"{where}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise bad
        return build_dataclass(tp, value, where)
    raise ParamsError(f"{where}: unsupported parameter type {tp!r} in the dataclass (use int/float/bool/str/...)")


def build_dataclass(cls: type[T], values: dict[str, Any], where: str, fill: dict[str, Any] | None = None) -> T:
    """Build ``cls`` from ``values``, rejecting unknown keys and mistyped values.

    ``where`` names the place for messages (``"params.yaml [world]"``); ``fill`` holds
    values used for fields absent from ``values`` (before the dataclass defaults).
    """
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    for key in values:
        if key not in fields:
            near = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.0)
            hint = f" Nearest valid key: '{near[0]}' (expects {_type_name(hints[near[0]])})." if near else ""
            raise ParamsError(
                f"{where}: unknown key '{key}'.{hint} Valid keys: {', '.join(sorted(fields))}. "
                f"Fix the spelling or remove the key."
            )
    kwargs: dict[str, Any] = {}
    for name, field in fields.items():
        if name in values:
            kwargs[name] = _coerce(values[name], hints[name], f"{where}: key '{name}'")
        elif fill and name in fill:
            kwargs[name] = _coerce(fill[name], hints[name], f"{where}: key '{name}'")
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise ParamsError(f"{where}: required key '{name}' ({_type_name(hints[name])}) is missing")
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:  # __post_init__ validation
        raise ParamsError(f"{where}: {exc}") from None


def load_base(doc: dict[str, Any], path: str | Path = "params.yaml") -> BaseParams:
    """Validate the ``base`` section and that its profile exists."""
    base = build_dataclass(BaseParams, doc.get("base") or {}, f"{path} [base]")
    profiles = doc.get("profiles") or {}
    if base.profile not in profiles:
        near = difflib.get_close_matches(base.profile, list(profiles), n=1, cutoff=0.0)
        hint = f" Nearest: '{near[0]}'." if near else ""
        raise ParamsError(
            f"{path} [base]: key 'profile' names '{base.profile}', which is not under 'profiles'.{hint} "
            f"Known profiles: {', '.join(sorted(profiles)) or '(none)'}."
        )
    return base


def section_values(doc: dict[str, Any], section: str, path: str | Path = "params.yaml") -> dict[str, Any]:
    """The section's raw values with the active profile's overrides applied."""
    base = load_base(doc, path)
    if section not in doc:
        near = difflib.get_close_matches(section, [k for k in doc if k not in ("base", "profiles")], n=1)
        hint = f" Did you mean '{near[0]}'?" if near else ""
        raise ParamsError(f"{path}: section '{section}' is missing.{hint} Add it (it may be empty: '{section}: {{}}').")
    values = dict(doc.get(section) or {})
    profile = (doc.get("profiles") or {}).get(base.profile) or {}
    if section not in profile:
        raise ParamsError(
            f"{path} [profiles.{base.profile}]: has no entry for section '{section}'; "
            f"add '{section}: {{}}' (DVC tracks profiles.{base.profile}.{section})."
        )
    overrides = profile.get(section) or {}
    if not isinstance(overrides, dict):
        raise ParamsError(f"{path} [profiles.{base.profile}.{section}]: must be a mapping, found {overrides!r}")
    values.update(overrides)
    return values


def load_params(section: str, cls: type[T], path: str | Path = "params.yaml") -> T:
    """Load one stage's section of params.yaml (with its profile applied) into ``cls``."""
    doc = read_params_file(path)
    base = load_base(doc, path)
    values = section_values(doc, section, path)
    where = f"{path} [{section}, profile {base.profile}]"
    return build_dataclass(cls, values, where, fill={"seed": base.seed})
