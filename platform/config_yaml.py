"""Reading configs' YAML: PyYAML's safe loader without its YAML 1.1 surprises.

``010`` is ten (not eight), ``1:30`` the string "1:30" (not ninety), a key given twice is
refused (PyYAML keeps the last silently), and aliases that would expand a few hundred bytes
into a huge document ("billion laughs") are refused. Used by :mod:`raylane.config` for
config files and ``--set`` values; refusals are :class:`YAMLRefused` naming the dotted key
and the line, which the config module turns into its ``ConfigError``.
"""

from __future__ import annotations

import re
from typing import Any

import yaml


class YAMLRefused(ValueError):
    """A YAML document that parses but is refused (a duplicate key, aliases past the bound)."""


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


_INT_TAG, _FLOAT_TAG = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
# YAML 1.1's int and float patterns less the sexagesimal forms (`1:30` was 90), plus
# YAML 1.2's `0o` octal; a leading zero no longer means octal (see _construct_int).
_INT = re.compile(r"""^(?:[-+]?0b[0-1_]*[0-1][0-1_]*
                    |[-+]?0o[0-7_]*[0-7][0-7_]*
                    |[-+]?0x[0-9a-fA-F_]*[0-9a-fA-F][0-9a-fA-F_]*
                    |[-+]?[0-9][0-9_]*)$""", re.X)
_FLOAT = re.compile(r"""^(?:[-+]?[0-9][0-9_]*\.[0-9_]*(?:[eE][-+][0-9]+)?
                    |\.[0-9][0-9_]*(?:[eE][-+][0-9]+)?
                    |[-+]?\.(?:inf|Inf|INF)
                    |\.(?:nan|NaN|NAN))$""", re.X)
_BASES = {"0b": 2, "0o": 8, "0x": 16}
MAX_ALIAS_NODES = 10_000
"""Most nodes that aliases may add to a document once expanded. A real config repeats a
block or two (``<<: *defaults``); a few hundred bytes of nested aliases (a "billion laughs")
expand to 10**9 nodes, which every later walk over the config would visit."""


def _construct_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    """Base from the prefix only: `010` is ten, `0o10` eight, `0x10` sixteen, `0b10` two."""
    text = str(loader.construct_scalar(node)).replace("_", "")
    sign = -1 if text.startswith("-") else 1
    digits = text.lstrip("+-")
    base = _BASES.get(digits[:2].lower(), 10)
    return sign * int(digits[2:] if base != 10 else digits, base)


class ConfigLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` for configs: numbers read as YAML 1.2 writes them (``010`` is
    ten, ``0o10`` eight, ``1:30`` the string "1:30"), duplicate keys refused at any depth,
    aliases bounded (:data:`MAX_ALIAS_NODES`) and never recursive. Refusals raise
    :class:`YAMLRefused` with the dotted key and line, without the source's name."""

    # Copies: the resolver table is a class attribute shared with yaml.SafeLoader.
    yaml_implicit_resolvers = {
        first: [(tag, {_INT_TAG: _INT, _FLOAT_TAG: _FLOAT}.get(tag, rx)) for tag, rx in pairs]
        for first, pairs in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    yaml_constructors = {**yaml.SafeLoader.yaml_constructors, _INT_TAG: _construct_int}

    def get_single_node(self) -> yaml.Node | None:
        node = super().get_single_node()
        if node is not None:
            sizes: dict[int, int] = {}
            expanded = self._expanded_size(node, "", sizes, set())
            if expanded - len(sizes) > MAX_ALIAS_NODES:
                raise YAMLRefused(f"aliases expand past the bound: {len(sizes)} written nodes would become {expanded} "
                                  f"(aliases may add at most {MAX_ALIAS_NODES}); write the values out instead of "
                                  "nesting aliases (*name) of anchored (&name) collections")
        return node

    def _expanded_size(self, node: yaml.Node, path: str, sizes: dict[int, int], open_: set[int]) -> int:
        """Nodes under ``node`` with every alias expanded; an aliased node is walked (and its
        keys checked) once, its size memoised in ``sizes`` by node id."""
        if id(node) in sizes:
            return sizes[id(node)]
        if id(node) in open_:
            raise YAMLRefused(f"{path or 'the document'} (line {node.start_mark.line + 1}): an alias refers to a "
                              "collection that contains it; a config must not be recursive")
        open_.add(id(node))
        size = 1
        if isinstance(node, yaml.SequenceNode):
            size += sum(self._expanded_size(v, f"{path}[{i}]", sizes, open_) for i, v in enumerate(node.value))
        elif isinstance(node, yaml.MappingNode):
            for label, key, value in self._keys(node, path):
                size += self._expanded_size(key, path, sizes, open_)
                size += self._expanded_size(value, _join(path, label), sizes, open_)
        open_.discard(id(node))
        sizes[id(node)] = size
        return size

    def _keys(self, node: yaml.MappingNode, path: str) -> list[tuple[str, yaml.Node, yaml.Node]]:
        """``(label, key node, value node)`` of a mapping; a key given twice is refused (PyYAML
        keeps the last silently). Merge keys (``<<``) may override, as YAML says."""
        seen: dict[Any, yaml.Node] = {}
        rows = []
        for key, value in node.value:
            label = str(key.value) if isinstance(key, yaml.ScalarNode) else "<key>"
            rows.append((label, key, value))
            if not isinstance(key, yaml.ScalarNode) or key.tag == "tag:yaml.org,2002:merge":
                continue
            ident = self.construct_object(key)  # `10` and `010` are one key
            if ident in seen:
                raise YAMLRefused(f"duplicate key {_join(path, label)!r} at line {key.start_mark.line + 1} (first given at "
                                  f"line {seen[ident].start_mark.line + 1}); give each key once")
            seen[ident] = key
        return rows


def safe_load(stream: Any) -> Any:
    """One YAML document read by :class:`ConfigLoader`."""
    try:
        return yaml.load(stream, Loader=ConfigLoader)
    except RecursionError:  # PyYAML composes recursively
        raise YAMLRefused("nested too deeply to read (more than a few hundred levels)") from None
