"""Plain dataclasses filled from JSON, with errors that name the dotted key.

    build(TrainConfig, json.load(f), where="configs/debug_3d.json")

`build` walks a dataclass's fields (type hints, `spec`'s checks) beside the JSON object. An
unknown key is an error naming its dotted path and the nearest known key ("lr": did you mean
"optimizer.params.lr"?); a value of the wrong type (a bool is not an int; an int is a float),
outside its choices or under its minimum is an error naming the key, the value and what was
expected. Keys starting with "_" are comments.
"""
from __future__ import annotations

import difflib
import json
import typing
from dataclasses import MISSING, field, fields, is_dataclass
from typing import Any, Optional, Union

__all__ = ["spec", "build", "parse_value", "set_dotted", "known_paths"]


def spec(default: Any = MISSING, *, choices=None, min=None, exclusive: bool = False,
         json: bool = True):
    """A dataclass field with the checks `build` applies: ``choices``, ``min`` (``exclusive``:
    strictly above it); ``json=False`` for a field that no JSON key may set."""
    return field(default=default, metadata=dict(choices=choices, min=min, exclusive=exclusive,
                                                json=json))


def _json_fields(cls) -> dict:
    return {f.name: f for f in fields(cls) if f.metadata.get("json", True)}


def _unwrap_optional(tp):
    """(inner type, whether None is allowed)."""
    if typing.get_origin(tp) is Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return (args[0] if len(args) == 1 else Union[tuple(args)]), type(None) in typing.get_args(tp)
    return tp, False


def known_paths(cls, prefix: str = "") -> list[str]:
    """Every dotted JSON key of a dataclass, blocks included."""
    out = []
    hints = typing.get_type_hints(cls)
    for name in _json_fields(cls):
        path = f"{prefix}{name}"
        out.append(path)
        inner, _ = _unwrap_optional(hints[name])
        if is_dataclass(inner):
            out += known_paths(inner, path + ".")
    return out


def _suggest(key: str, dotted: str, level: list[str], root) -> str:
    near = difflib.get_close_matches(key, level, n=1, cutoff=0.6)
    if near:
        parent = dotted.rpartition(".")[0]
        return f"; did you mean {(parent + '.' if parent else '') + near[0]!r}?"
    if root is not None:
        paths = known_paths(root)
        leaves = {p.rpartition(".")[2]: p for p in reversed(paths)}
        near = difflib.get_close_matches(key, list(leaves), n=1, cutoff=0.8)
        if near:
            return f"; did you mean {leaves[near[0]]!r}?"
    return f"; the keys here are {', '.join(level)}"


_TYPE_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def _what(tp) -> str:
    if typing.get_origin(tp) is tuple:
        return f"a list of {len(typing.get_args(tp))} numbers"
    if is_dataclass(tp):
        return "a JSON object"
    return _TYPE_NAMES.get(tp, getattr(tp, "__name__", str(tp)))


def _convert(tp, value, dotted: str, meta, where: str, root):
    inner, nullable = _unwrap_optional(tp)
    if value is None:
        if nullable:
            return None
        raise ValueError(f"{where}: {dotted} must be {_what(inner)}, got null")

    def wrong():
        return ValueError(f"{where}: {dotted} must be {_what(inner)}, got {value!r} "
                          f"({type(value).__name__})")

    if is_dataclass(inner):
        if not isinstance(value, dict):
            raise wrong()
        return build(inner, value, where=where, path=dotted, root=root)
    if typing.get_origin(inner) is tuple:
        n = len(typing.get_args(inner))
        if not (isinstance(value, list) and len(value) == n
                and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)):
            raise wrong()
        return tuple(float(v) for v in value)
    if inner is bool:
        ok = isinstance(value, bool)
    elif inner is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif inner is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    else:
        ok = isinstance(value, inner)
    if not ok:
        raise wrong()
    choices, low = meta.get("choices"), meta.get("min")
    if choices is not None and value not in choices:
        same = [str(c) for c in choices if str(c).lower() == str(value).lower()]   # "adamw"
        near = same or difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
        raise ValueError(f"{where}: {dotted}={value!r} must be one of "
                         f"{', '.join(repr(c) for c in choices)}"
                         + (f"; did you mean {near[0]!r}?" if near else ""))
    if low is not None and (value <= low if meta.get("exclusive") else value < low):
        raise ValueError(f"{where}: {dotted}={value!r} must be {'>' if meta.get('exclusive') else '>='}"
                         f" {low}")
    return value


def build(cls, raw: dict, *, where: str = "configuration", path: str = "", root=None):
    """An instance of dataclass ``cls`` from the JSON object ``raw``, every key checked."""
    root = root or cls
    known, hints, kwargs = _json_fields(cls), typing.get_type_hints(cls), {}
    for key, value in raw.items():
        if key.startswith("_"):
            continue                      # a comment
        dotted = f"{path}.{key}" if path else key
        if key not in known:
            raise ValueError(f"{where}: unknown key {dotted!r}"
                             + _suggest(key, dotted, list(known), root))
        kwargs[key] = _convert(hints[key], value, dotted, known[key].metadata, where, root)
    missing = [n for n, f in known.items() if n not in kwargs and f.default is MISSING
               and f.default_factory is MISSING]
    if missing:
        raise ValueError(f"{where}: {path or 'the configuration'} needs "
                         + ", ".join(f"{path + '.' if path else ''}{m}" for m in missing))
    try:
        return cls(**kwargs)
    except ValueError as e:             # a __post_init__ check, said once with the file's name
        raise (e if str(e).startswith(f"{where}: ") else ValueError(f"{where}: {e}")) from None


def parse_value(value: Any) -> Any:
    """A command-line string as the JSON value it spells ("3e-4" -> 0.0003, "[0.9, 0.95]" -> a
    list; Python's True, False and None too); any other string ("cpu") or non-string as it is."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return {"True": True, "False": False, "None": None}.get(value.strip(), value)


def set_dotted(raw: dict, key: str, value: Any, where: str = "configuration") -> None:
    """raw["a"]["b"]["c"] = value for key "a.b.c", creating the blocks that are missing."""
    parts = key.split(".")
    if not all(parts):
        raise ValueError(f"{where}: override key {key!r} has an empty part")
    node: Optional[dict] = raw
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ValueError(f"{where}: cannot override {key!r}: {'.'.join(parts[:i + 1])} is "
                             f"{child!r}, not a block")
        node = child
    node[parts[-1]] = value
