"""YAML in and out: the dialect (`load_yaml`, `to_yaml`), config files with their base chain, the deep
merge that records who set each key, and the command-line overrides `a.b.c=value`."""

from __future__ import annotations

import copy
import os
import re
from typing import Any

import yaml

from rl.config.errors import ConfigError, _Problem, _unknown
from rl.config.fields import _allowed, _fields, _hints, _is_section, _item_type, _kind, _non_none, _plain, _show
from rl.config.run import RunConfig
from rl.config.model_section import ModelSection
from rl.config.validate import _m3_field_names


# ============================================================================== YAML dialect
_INT_RE = re.compile(r"^(?:[-+]?(?:0|[1-9][0-9_]*)|0x_*[0-9a-fA-F][0-9a-fA-F_]*|0o_*[0-7][0-7_]*)$")  # a digit
_FLOAT_RE = re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                          |[-+]?(?:[0-9][0-9_]*)[eE][-+]?[0-9]+
                          |[-+]?\.[0-9_]+(?:[eE][-+]?[0-9]+)?
                          |[-+]?\.(?:inf|Inf|INF)
                          |\.(?:nan|NaN|NAN))$""", re.X)
_INT_TAG, _FLOAT_TAG = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"


class _Loader(yaml.SafeLoader):
    pass


_Loader.yaml_implicit_resolvers = {
    ch: [(tag, rx) for tag, rx in rs if tag not in (_INT_TAG, _FLOAT_TAG)]
    for ch, rs in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_Loader.add_implicit_resolver(_INT_TAG, _INT_RE, list("-+0123456789"))
_Loader.add_implicit_resolver(_FLOAT_TAG, _FLOAT_RE, list("-+0123456789."))


def _construct_int(loader, node):
    text = loader.construct_scalar(node).replace("_", "")
    if text.startswith("0o"):
        return int(text[2:], 8)
    return int(text, 0) if text.startswith("0x") else int(text)


def _construct_map(loader, node):
    """A mapping whose own keys are each given once; keys merged in from anchors (`<<: *base`) are overridden by the
    mapping's own, as YAML's merge means (checked after the merge, they were refused as repeats)."""
    own = [key_node for key_node, _ in node.value if key_node.tag != "tag:yaml.org,2002:merge"]
    seen = set()
    for key_node in own:
        key = loader.construct_object(key_node, deep=True)
        try:
            dup = key in seen
            seen.add(key)
        except TypeError:
            raise yaml.constructor.ConstructorError(None, None, f"unhashable key {key!r}",
                                                    key_node.start_mark) from None
        if dup:
            raise yaml.constructor.ConstructorError(None, None, f"key {key!r} appears twice in one mapping",
                                                    key_node.start_mark)
    loader.flatten_mapping(node)
    return loader.construct_mapping(node, deep=True)


_Loader.add_constructor(_INT_TAG, _construct_int)
_Loader.add_constructor("tag:yaml.org,2002:map", _construct_map)


class _Dumper(yaml.SafeDumper):
    """Quotes every string that either YAML 1.1 or this module's dialect would read as something else."""


_Dumper.add_implicit_resolver(_INT_TAG, _INT_RE, list("-+0123456789"))
_Dumper.add_implicit_resolver(_FLOAT_TAG, _FLOAT_RE, list("-+0123456789."))


def _represent_list(dumper, data):
    flow = all(not isinstance(x, (list, tuple, dict)) for x in data)  # [data, context] on one line
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flow)


_Dumper.add_representer(list, _represent_list)


def load_yaml(text_or_stream: Any) -> Any:
    """Parse YAML in this dialect (see the `rl.config` docstring)."""
    return yaml.load(text_or_stream, Loader=_Loader)


def as_dict(cfg: Any) -> dict:
    """The config as plain YAML-ready data (tuples become lists)."""
    return _plain(cfg)


def to_yaml(cfg: RunConfig) -> str:
    """The resolved config as YAML (for --print-config); `load_config` of it gives back an equal config."""
    return yaml.dump(as_dict(cfg), Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=110,
                     allow_unicode=True)


# ============================================================================== files, merging, overrides
def _display(path: str) -> str:
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def _merge(dst: dict, src: dict, sources: dict[str, str], source: str, prefix: str = "") -> None:
    """Deep-merge `src` into `dst` (mappings merge, everything else replaces), noting who set each key."""
    for k, v in src.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict):
            # a model preset starts a model over: keys of the mapping it lands on (a tiny model's) would replace
            # the preset's own fields without a word
            if not isinstance(dst.get(k), dict) or (key == "model.tiny" and "preset" in v):
                dst[k] = {}
                for old in [s for s in sources if s == key or s.startswith(key + ".")]:
                    del sources[old]
            _merge(dst[k], v, sources, source, key)
            if not v:
                sources.setdefault(key, source)
        else:
            dst[k] = copy.deepcopy(v)
            for old in [s for s in sources if s == key or s.startswith(key + ".")]:
                del sources[old]
            sources[key] = source


def _read_file(path: str, chain: list[str]) -> dict:
    shown = _display(path)
    try:
        with open(path, encoding="utf-8") as fh:
            data = load_yaml(fh)
    except FileNotFoundError:
        if chain:
            raise ConfigError(f"base: {shown} (named by {_display(chain[-1])}) does not exist; allowed: a YAML "
                              "file path relative to the file that names it") from None
        raise ConfigError(f"config file {shown} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {shown} is a directory, not a YAML file") from None
    except OSError as e:
        raise ConfigError(f"config file {shown} cannot be read: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {shown} is not UTF-8 text (byte {e.start}); allowed: a YAML file") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        where = f"{shown}:{mark.line + 1}:{mark.column + 1}" if mark else shown
        what = getattr(e, "problem", None) or str(e)
        ctx = getattr(e, "context", None)
        raise ConfigError(f"{where}: malformed YAML: {what}" + (f" ({ctx})" if ctx else "")) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{shown}: the top level is {_kind(data)}; allowed: a mapping of sections "
                          f"({', '.join(_fields(RunConfig))}) and an optional base")
    return data


def load_tree(path: str, chain: list[str], sources: dict[str, str]) -> dict:
    path = os.path.abspath(path)
    if path in chain:
        cycle = " -> ".join(_display(p) for p in chain[chain.index(path):] + [path])
        raise ConfigError(f"base: cycle of config files: {cycle}; allowed: a chain that ends in a file without base")
    data = _read_file(path, chain)
    base = data.pop("base", None)
    tree: dict = {}
    if base is not None:
        if not isinstance(base, str) or not base.strip():
            raise ConfigError(f"base = {_show(base)} in {_display(path)}: wrong type ({_kind(base)}); allowed: "
                              "the path of another YAML file, relative to this one")
        tree = load_tree(os.path.join(os.path.dirname(path), base), chain + [path], sources)
    for name in [k for k, v in data.items() if v is None and _names_section(k)]:
        del data[name]  # `grpo:` with nothing under it: as `grpo: {}`, it inherits (null replaced the base's section)
    _merge(tree, data, sources, _display(path))
    return tree


def _names_section(key: Any) -> bool:
    hint = _hints(RunConfig).get(key) if isinstance(key, str) else None
    return hint is not None and _is_section(_non_none(hint))


def _override_target(parts: list[str], text: str) -> tuple[Any, dict] | _Problem:
    """The (type, metadata) an override key names, or the problem with the key."""
    cls: Any = RunConfig
    for i, part in enumerate(parts):
        key = ".".join(parts[:i + 1])
        fields = _fields(cls)
        if part not in fields:
            return _unknown(key, list(fields), ".".join(parts[:i]) or "the top level")
        tp, meta = _hints(cls)[part], dict(fields[part].metadata)
        if i == len(parts) - 1:
            return tp, meta
        inner = _non_none(tp)
        if _is_section(inner):
            cls = inner
        elif cls is ModelSection and part == "tiny":
            rest = parts[i + 1:]
            names = [*_m3_field_names()[0], "preset"]  # preset: m3jax.presets, expanded by ModelSection
            if rest[0] not in names:
                return _unknown(f"{key}.{rest[0]}", names, "model.tiny (M3Config fields, preset)")
            if len(rest) > 1:
                return _Problem(key, f"override {text!r}: {key}.{rest[0]} has no sub-keys; allowed: "
                                     f"{key}.{rest[0]}=<value>")
            return Any, {"allowed": "a model preset's name" if rest[0] == "preset" else
                         f"a value for M3Config.{rest[0]}"}
        elif _item_type(inner) is not None:
            return _Problem(key, f"override {text!r}: {key} is a list, so it has no sub-keys; allowed: the whole "
                                 f"list, e.g. {key}='[...]' ({_allowed(tp, meta)})")
        else:
            return _Problem(key, f"override {text!r}: {key} is {_allowed(tp, meta)}, it has no sub-keys; "
                                 f"allowed: {key}=<value>")
    raise AssertionError("unreachable")


def apply_overrides(tree: dict, overrides: list[str], sources: dict[str, str]) -> None:
    problems: list[str] = []
    for text in overrides:
        key, sep, raw = str(text).partition("=")
        key = key.strip()
        parts = key.split(".")
        if not sep or not key or not all(parts):
            problems.append(f"override {text!r}: expected key.sub=value (e.g. grpo.group_size=8)")
            continue
        target = _override_target(parts, text)
        if isinstance(target, _Problem):
            problems.append(target.text if target.text.startswith("override") else f"override {text!r}: "
                            + target.text)
            continue
        tp, meta = target
        try:
            value = load_yaml(raw) if raw.strip() else None
        except yaml.YAMLError as e:
            what = getattr(e, "problem", None) or str(e).splitlines()[0]
            problems.append(f"override {text!r}: the value {raw!r} for {key} is not valid YAML ({what}); "
                            f"allowed: {_allowed(tp, meta)} (quote strings that contain YAML syntax)")
            continue
        if _is_section(_non_none(tp)) and not isinstance(value, dict):  # a later grpo.x=... would reset the section
            problems.append(f"override {text!r}: {key} is a section, so it takes its keys ({key}.<key>=value) or a "
                            f"mapping ({key}='{{<key>: value}}'), not {_kind(value)}")
            continue
        if parts == ["model", "tiny", "preset"]:  # replaces the inherited model.tiny, as a mapping with it does
            parts, value = parts[:2], {"preset": value}
        node = tree
        for n, p in enumerate(parts[:-1]):
            if not isinstance(node.get(p), dict):  # e.g. model.tiny.hidden_size=64 over model.tiny: null
                node[p] = {}
                here = ".".join(parts[:n + 1])
                for old in [s for s in sources if s == here or s.startswith(here + ".")]:
                    del sources[old]
            node = node[p]
        _merge(node, {parts[-1]: value}, sources, f"override {text!r}", ".".join(parts[:-1]))
    if problems:
        raise ConfigError(problems)
