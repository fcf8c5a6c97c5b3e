"""Typed configurations from dataclasses: command-line flags, KEY=VALUE overrides, TOML/YAML/JSON.

A configuration is a dataclass. Its fields are the keys and their annotations the types: bool,
int, float, str, ``Optional[...]``, ``list[...]``, ``Literal[...]``, ``Union[int, Literal["auto"]]``,
``dict``, or another dataclass (a section: its keys are ``section.name``). A field's metadata may
hold ``help`` (the flag's help), ``choices`` (the allowed values), ``low`` / ``high`` (numeric
bounds, ``low_open`` / ``high_open`` to exclude them; on a list, for every entry; checked by
``lintrans.checks.check_number``) and, on a ``dict`` field, ``schema``: a
dataclass whose fields are the keys that dict may hold (a sparse section, e.g. the training
config's ``model``, whose keys are GPTConfig's).

    add_arguments(parser, Cls)    # --name / --section.name flags, one per key, help from the metadata
    given_flags(args)             # the flags given on the command line, as (key, text) pairs
    set_key(obj, key, value)      # one key, converted/checked (ValueError/TypeError naming the key)
    check_fields(obj)             # every key of a config built in code, checked the same way
    apply_overrides(obj, items)   # "KEY=VALUE" strings, as --set takes them
    from_dict(Cls, data)          # a nested mapping (a TOML/YAML/JSON file) -> Cls; unknown keys rejected
    read_file(path)               # a .toml/.yaml/.yml/.json file -> dict
    dump(obj)                     # YAML text that from_dict/read_file read back

Command-line values are text: each is converted to its key's type (``true``/``false`` for bools,
``none`` for optional keys, JSON or YAML for lists and tables). Values from files must already
have the key's type (an int is accepted for a float). Errors name the key through ``label``
(default ``config key 'train.max_steps'``) and say what is allowed.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import typing
from pathlib import Path
from typing import Any, Callable, Literal, Optional, Union

from lintrans.checks import check_choice, check_number

BOUNDS = ("low", "high", "low_open", "high_open")  # field metadata passed to check_number

Label = Callable[[str], str]


def config_key(key: str) -> str:
    return f"config key {key!r}"


# ---- keys and their types --------------------------------------------------------------------


def _hints(cls) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _section(cls, name: str):
    """The dataclass of section ``name`` of ``cls`` (a dataclass field, or a dict field with a
    ``schema``), or None when ``name`` is not a section."""
    f = {f.name: f for f in dataclasses.fields(cls)}.get(name)
    if f is None:
        return None
    typ = _hints(cls)[name]
    return typ if dataclasses.is_dataclass(typ) else f.metadata.get("schema")


def keys(cls, prefix: str = "") -> dict[str, tuple[Any, dict]]:
    """Every settable key of ``cls`` ("name" or "section.name") -> (type, field metadata with its
    ``default`` added)."""
    out = {}
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        if _section(cls, f.name) is not None:
            out.update(keys(_section(cls, f.name), f"{prefix}{f.name}."))
        else:
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            out[prefix + f.name] = (hints[f.name], {**f.metadata, "default": default})
    return out


def sections(cls) -> list[str]:
    """Names of the fields of ``cls`` that are sections (dataclasses or dicts with a schema)."""
    return [f.name for f in dataclasses.fields(cls) if _section(cls, f.name) is not None]


def _optional(typ) -> tuple[bool, Any]:
    """(whether None is allowed, the type without None)."""
    if typing.get_origin(typ) is Union:
        args = [a for a in typing.get_args(typ) if a is not type(None)]
        rest = args[0] if len(args) == 1 else Union[tuple(args)]
        return len(args) < len(typing.get_args(typ)), rest
    return False, typ


def describe(typ, meta: Optional[dict] = None) -> str:
    """'an int >= 1', 'a list of str', "one of ['a', 'b']", 'a bool or None', ... for messages."""
    meta = meta or {}
    optional, typ = _optional(typ)
    origin = typing.get_origin(typ)
    if meta.get("choices") is not None:
        text = f"one of {list(meta['choices'])}"
    elif origin is Literal:
        text = f"one of {list(typing.get_args(typ))}"
    elif origin is Union:
        bounds = {k: meta[k] for k in BOUNDS if k in meta}
        text = " or ".join(describe(a, bounds) for a in typing.get_args(typ))
    elif origin is list:
        (item,) = typing.get_args(typ) or (Any,)
        bounds = {k: meta[k] for k in BOUNDS if k in meta}  # a list's bounds hold for every entry
        text = "a list of " + (describe(item, bounds).split(" ", 1)[1] if item is not Any else "values")
    elif typ is dict or origin is dict:
        text = "a table (mapping)"
    elif typ in (int, float):
        text = "an int" if typ is int else "a number"
        low, high = meta.get("low"), meta.get("high")
        lo, hi = meta.get("low_open"), meta.get("high_open")
        text += f" in {'(' if lo else '['}{low}, {high}{')' if hi else ']'}" if low is not None and high is not None \
            else f" {'>' if lo else '>='} {low}" if low is not None else f" {'<' if hi else '<='} {high}" \
            if high is not None else ""
    else:
        name = getattr(typ, "__name__", str(typ))
        text = ("an " if name[0] in "aeiou" else "a ") + name
    return text + (" or None" if optional else "")


def parse_text(text: str):
    """A command-line value: JSON, else YAML (scalars, lists, mappings), else the text itself."""
    import yaml

    try:
        return json.loads(text)
    except ValueError:
        pass
    try:
        return yaml_load(text)  # the same YAML as config files: 1e-3 a number
    except yaml.YAMLError:
        return text


_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no")


def convert(name: str, value, typ, meta: Optional[dict] = None, *, from_text: bool = False):
    """``value`` as type ``typ`` (text converted when ``from_text``), checked against the field's
    ``choices`` and bounds; TypeError/ValueError naming ``name`` otherwise."""
    meta = meta or {}
    optional, base = _optional(typ)
    origin = typing.get_origin(base)

    def bad(kind=TypeError):
        return kind(f"{name} must be {describe(typ, meta)}, got {value!r}")

    if from_text and isinstance(value, str):
        text = value.strip()
        if optional and text.lower() in ("none", "null", ""):
            return None
        if base is bool:
            if text.lower() not in _TRUE + _FALSE:
                raise bad()
            value = text.lower() in _TRUE
        elif base is int or base is float:
            try:
                value = base(text)
            except ValueError:
                raise bad() from None
        elif base is str:
            value = text
        elif origin is not Literal:
            value = parse_text(text)
            if origin is Union and isinstance(value, (dict, list)):
                raise bad()
    if value is None:
        if optional:
            return None
        raise bad()
    if origin is Union:  # e.g. Union[int, Literal["auto"]]: the first member that takes the value
        error = None
        for member in typing.get_args(base):
            try:
                return convert(name, value, member, meta)
            except (TypeError, ValueError) as e:
                if member in (int, float) and isinstance(value, (int, float)) and not isinstance(value, bool):
                    error = e  # a number out of range says more than "not one of the types"
        raise error if error is not None else bad()
    if origin is Literal:
        if isinstance(value, bool):
            raise bad(ValueError)
        check_choice(name, value, typing.get_args(base))
        return value
    if meta.get("choices") is not None:
        if base in (int, float, str, bool) and not isinstance(value, base):
            raise bad()
        check_choice(name, value, meta["choices"])
        return value
    if origin is list:
        if from_text and isinstance(value, list) and len(value) == 1 and isinstance(value[0], str) \
                and value[0].lstrip().startswith("["):
            value = parse_text(value[0])  # one JSON word for a list flag: --lrs [1e-3,3e-3]
        if isinstance(value, tuple):
            value = list(value)
        if not isinstance(value, list):
            raise bad()
        (item,) = typing.get_args(base) or (Any,)
        bounds = {k: meta[k] for k in BOUNDS if k in meta}
        return value if item is Any else [convert(f"every entry of {name}", v, item, bounds, from_text=from_text)
                                          for v in value]
    if base is dict or origin is dict:
        if not isinstance(value, dict):
            raise bad()
        return value
    if base in (int, float):
        if base is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number, got {value}")
        check_number(name, value, integer=base is int, allow_none=optional, **{k: meta[k] for k in BOUNDS if k in meta})
        return value
    if base is Any:
        return value
    if not isinstance(value, base) or (base is not bool and isinstance(value, bool)):
        raise bad()
    return value


# ---- setting keys ----------------------------------------------------------------------------


def _unknown(obj, key: str, label: Label) -> ValueError:
    cls = type(obj)
    parts = key.split(".")
    node, path = cls, []
    for p in parts[:-1]:  # the deepest section that exists
        if _section(node, p) is None:
            break
        node, path = _section(node, p), path + [p]
    names = [f.name for f in dataclasses.fields(node)]
    if not path and parts[0] not in names and sections(cls) == names:
        return ValueError(f"unknown {label(key)}: sections are {names}")
    if path:
        return ValueError(f"unknown {label(key)}; keys of [{'.'.join(path)}] are {sorted(names)}")
    return ValueError(f"unknown {label(key)}; allowed: {sorted(names)}")


def _parent(obj, parts: list[str]):
    """The object or dict that holds the key ``parts`` (sections are dataclasses or dicts)."""
    node = obj
    for p in parts[:-1]:
        node = node[p] if isinstance(node, dict) else getattr(node, p)
    return node


def set_key(obj, key: str, value, *, from_text: bool = False, label: Label = config_key) -> None:
    """Set ``key`` ("name", "section.name", or a key inside a dict-valued one such as
    ``model.attention_options.feature_map``) of the config ``obj`` to ``value``, converted and checked."""
    table = keys(type(obj))
    parts = key.split(".")
    n = next((n for n in range(len(parts), 0, -1) if ".".join(parts[:n]) in table), 0)
    if n == 0:
        raise _unknown(obj, key, label)
    head = ".".join(parts[:n])
    typ, meta = table[head]
    if n < len(parts):  # inside a dict-valued key
        _, base = _optional(typ)
        if base is not dict and typing.get_origin(base) is not dict:
            raise ValueError(f"{label(head)} is not a table, so {key!r} cannot be set")
        parent = _parent(obj, parts[:n])
        current = parent.get(parts[n - 1]) if isinstance(parent, dict) else getattr(parent, parts[n - 1])
        container = json.loads(json.dumps(current or {}))  # a copy: the old value stays if this fails
        node = container
        for i, p in enumerate(parts[n:-1], start=n):
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ValueError(f"{label('.'.join(parts[:i + 1]))} is {node!r}, not a table, so {key!r} cannot be set")
        node[parts[-1]] = parse_text(value) if from_text and isinstance(value, str) else value
        value, from_text = container, False
    value = convert(label(head), value, typ, meta, from_text=from_text)
    parent = _parent(obj, parts[:n])
    if isinstance(parent, dict):
        parent[parts[n - 1]] = value
    else:
        setattr(parent, parts[n - 1], value)


def split_override(item: str) -> tuple[str, str]:
    key, sep, value = item.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"override {item!r} must look like KEY=VALUE (e.g. section.key=value)")
    return key.strip(), value


def apply_overrides(obj, items, *, label: Label = config_key):
    """Apply "KEY=VALUE" strings (command-line text) in order; returns ``obj``."""
    for item in items:
        key, value = split_override(item)
        set_key(obj, key, value, from_text=True, label=label)
    return obj


def flatten(cls, data, prefix: str = "") -> dict:
    """{"train": {"max_steps": 5}} -> {"train.max_steps": 5}: mappings are opened down to the keys
    of ``cls`` (a dict-valued key stays whole)."""
    if not isinstance(data, dict):
        where = f" section [{prefix[:-1]}]" if prefix else ""
        raise TypeError(f"config{where} must be a table/mapping, got {data!r}")
    out = {}
    for name, value in data.items():
        section = _section(cls, name) if isinstance(name, str) else None
        if section is not None:
            out.update(flatten(section, value, f"{prefix}{name}."))
        else:
            out[prefix + str(name)] = value
    return out


def from_dict(cls, data: dict, *, label: Label = config_key):
    """``cls()`` with every key of the nested mapping ``data`` set (checked as files are: no text conversion)."""
    obj = cls()
    for key, value in flatten(cls, data).items():
        set_key(obj, key, value, label=label)
    return obj


def check_fields(obj, *, label: Label = config_key, prefix: str = "") -> None:
    """Check every key of the dataclass instance ``obj`` (sections included) against its type and
    field metadata, as ``set_key`` checks a key set one at a time; a float key given an int becomes
    a float. For configs built in code (``GPTConfig(n_layer=0)``) and after their keys were set."""
    hints = _hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(hints[f.name]):
            check_fields(value, label=label, prefix=f"{prefix}{f.name}.")
        else:
            setattr(obj, f.name, convert(label(prefix + f.name), value, hints[f.name], dict(f.metadata)))


def to_dict(obj) -> dict:
    return dataclasses.asdict(obj)


def dump(obj) -> str:
    """The config as YAML (keys in field order), which ``read_file`` and ``from_dict`` read back."""
    import yaml

    return yaml.safe_dump(obj if isinstance(obj, dict) else to_dict(obj), sort_keys=False)


# ---- command-line flags ----------------------------------------------------------------------


def flag_name(key: str) -> str:
    """``plot_only`` -> ``--plot-only``; section keys keep their spelling (``--train.max_steps``)."""
    return "--" + (key if "." in key else key.replace("_", "-"))


_PLAIN = ("an int", "a number", "a str", "a bool", "a list of int", "a list of number", "a list of str")


def flag_help(typ, meta: dict) -> str:
    """A flag's help: the key's own text, then what the metavar does not already say (bounds,
    choices, a nested type) and the default when there is one."""
    _, base = _optional(typ)
    text = describe(base, meta)
    extra = [] if text in _PLAIN else [text]
    default = meta.get("default")
    if default is not None:
        extra.append("default " + (default if isinstance(default, str) else json.dumps(default, default=str)))
    return " ".join(filter(None, [meta.get("help", ""), f"[{'; '.join(extra)}]" if extra else ""]))


def add_arguments(parser, cls, *, dest: str = "key:", hidden: bool = False, skip=(),
                  defaults: Optional[dict] = None) -> None:
    """One flag per key of ``cls``, taking text (converted later by ``set_key``, so a bad value is a
    one-line error naming the key, not argparse's usage text). Lists of scalars take several words
    (``--lrs 1e-3 3e-3``); bools take an optional word (``--quick``, ``--compile false``) and
    top-level ones a ``--no-NAME`` too. ``hidden`` keeps the flags out of ``--help``. ``defaults``
    ({key: value}) are the defaults ``--help`` shows where the command starts from other values than
    ``cls``'s own (``lintrans train``: its shipped tiny config)."""
    for key, (typ, meta) in keys(cls).items():
        if key in skip:
            continue
        if defaults is not None and key in defaults:
            meta = {**meta, "default": defaults[key]}
        _, base = _optional(typ)
        kw: dict = {"dest": dest + key, "default": None}
        if base is bool:
            kw.update(nargs="?", const="true", metavar="BOOL")
        elif typing.get_origin(base) is list and typing.get_args(base)[0] in (int, float, str):
            kw.update(nargs="+", metavar=typing.get_args(base)[0].__name__.upper())
        else:
            kw["metavar"] = "VALUE" if typing.get_origin(base) else getattr(base, "__name__", "VALUE").upper()
        kw["help"] = argparse.SUPPRESS if hidden else flag_help(typ, meta)
        parser.add_argument(flag_name(key), **kw)
        if flag_name(key) != f"--{key}":  # the key's own spelling works too (--plot_only), unlisted
            parser.add_argument(f"--{key}", **{**kw, "help": argparse.SUPPRESS})
        if base is bool and "." not in key:
            parser.add_argument(f"--no-{key.replace('_', '-')}", dest=dest + key, action="store_const",
                                const="false", help=argparse.SUPPRESS)


def given_flags(args: argparse.Namespace, dest: str = "key:") -> list[tuple[str, Any]]:
    """The (key, text or list of texts) of every flag from ``add_arguments`` that was given."""
    return [(name[len(dest):], value) for name, value in vars(args).items()
            if name.startswith(dest) and value is not None]


def apply_flags(obj, args: argparse.Namespace, *, dest: str = "key:", label: Label = config_key):
    """Set every key whose flag was given; returns ``obj``."""
    for key, value in given_flags(args, dest):
        set_key(obj, key, value, from_text=True, label=label)
    return obj


# ---- files -----------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _yaml_loader():
    """PyYAML's safe loader with YAML 1.2's floats, built once (yaml imported on first use)."""
    import re

    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
        list("-+0123456789"))
    return Loader


def yaml_load(text: str):
    """YAML with YAML 1.2's floats: PyYAML's safe loader (YAML 1.1) reads 1e-3 and 3e-4, as people write
    learning rates, as strings; here they are numbers, as in TOML and JSON."""
    import yaml

    return yaml.load(text, Loader=_yaml_loader())


def read_file(path) -> dict:
    """A TOML (.toml), YAML (.yaml/.yml) or JSON (.json) file as a dict; errors name the file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {path} {'is a folder, not a file' if path.is_dir() else 'does not exist'}")
    text = path.read_text()
    if path.suffix == ".toml":
        try:
            import tomllib
        except ImportError:  # Python 3.10
            try:
                import tomli as tomllib
            except ImportError:
                raise ImportError("reading TOML on Python 3.10 needs 'tomli' (pip install tomli), or use YAML") from None
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"config file {path} is not valid TOML: {e}") from None
    elif path.suffix in (".yaml", ".yml"):
        import yaml

        try:
            data = yaml_load(text) or {}
        except yaml.YAMLError as e:
            raise ValueError(f"config file {path} is not valid YAML: {e}") from None
    elif path.suffix == ".json":
        try:
            data = json.loads(text)
        except ValueError as e:
            raise ValueError(f"config file {path} is not valid JSON: {e}") from None
    else:
        raise ValueError(f"config file {path} must end in .toml, .yaml, .yml or .json")
    if not isinstance(data, dict):
        raise ValueError(f"config file {path} must hold a mapping of sections, got {type(data).__name__}")
    return data
