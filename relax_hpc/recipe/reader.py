"""Recipe text read with bounds: a file, a command-line override's value, the YAML a key points to.

A recipe is a few KB of YAML. Without bounds, a careless or hostile one crashed or hung everything that reads
it: YAML nested 1000 deep ended in a RecursionError, a 1 KB alias bomb (``&a [x,x,..]``, ``&b [*a,*a,..]``, ...)
made the validator walk 10^9 shared nodes, a file that is not UTF-8 raised a bare UnicodeDecodeError, and a FIFO
in place of the file blocked the open for ever. Here the text must be a regular file of at most
:data:`MAX_BYTES` of UTF-8, and the YAML it holds, with every alias expanded, at most :data:`MAX_DEPTH` levels
deep and :data:`MAX_NODES` values (:data:`MAX_CHARS` characters) in all. Each refusal says what and where.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import yaml
from yaml.nodes import MappingNode, ScalarNode

# PyYAML's pure-Python parser (the C one gives no hook to measure nodes as they are composed) reads ~200 KB/s:
# the bounds keep the worst text to about a second; the resolved quickstart is 3 KB, 250 values, 4 levels.
MAX_BYTES = 256 << 10
"""A recipe file (or one override's value) is at most 256 KiB."""
MAX_DEPTH = 32
"""Nesting of mappings and lists, aliases expanded."""
MAX_NODES = 5_000
"""Values (scalars, lists, mappings), aliases expanded."""
MAX_CHARS = 1 << 20
"""Characters of all scalars together, aliases expanded."""


class TextError(ValueError):
    """Text that is not read: the message says what is wrong with it and the fix (not where: the caller knows)."""


class LimitError(yaml.MarkedYAMLError):
    """YAML over a bound: a YAMLError, so it carries the line and column like a syntax error."""


def read_text(path: str | Path, max_bytes: int = MAX_BYTES) -> str:
    """The UTF-8 text of the regular file ``path``. FileNotFoundError as is; anything else is a TextError.

    Opened without blocking, so a FIFO or a device in place of the file is refused instead of waited on."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as e:  # ValueError: a NUL byte in the path
        raise TextError(f"cannot be opened ({getattr(e, 'strerror', None) or e})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise TextError(f"is not a regular file but {_file_kind(st.st_mode)}. Fix: give a YAML file")
        if st.st_size > max_bytes:
            raise TextError(f"is {st.st_size} bytes, more than the {max_bytes} a recipe may have. Fix: give the "
                            "right file (a recipe is a few KB of YAML)")
        chunks, left = [], max_bytes + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 16))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
    except OSError as e:
        raise TextError(f"cannot be read ({e.strerror or e})") from None
    finally:
        os.close(fd)
    if len(data) > max_bytes:  # it grew while we read
        raise TextError(f"is more than {max_bytes} bytes. Fix: give the right file (a recipe is a few KB of YAML)")
    return decode(data)


def decode(data: bytes) -> str:
    """``data`` as UTF-8; a TextError naming the first bad byte's line and column."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise TextError(f"is not UTF-8 text: byte 0x{data[e.start]:02x} at line {line}, column {column} "
                        f"(offset {e.start}). Fix: save it as UTF-8") from None


def _file_kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader that measures each node as it is composed, with aliases expanded: depth, values, characters.

    Aliases share one node, so measuring costs one pass over the text; what is bounded is the tree every
    later walk (the validator, a deep copy, ``str()``) sees. YAML merge keys (``<<: *a``) copy the aliased
    pairs, so they are bounded the same way."""

    def __init__(self, stream: str):
        super().__init__(stream)
        self._depth = 0
        self._composed = 0  # nodes composed so far: a long list is refused at its MAX_NODES-th item, not at its end
        self._sizes: dict[int, tuple[int, int, int]] = {}  # id(node) -> (values, characters, height)

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            node = self.anchors.get(event.anchor)
            if node is not None and id(node) not in self._sizes:
                raise LimitError(None, None, f"the alias *{event.anchor} is inside the value it names (a recursive "
                                 "structure). Fix: write the value out", event.start_mark)
            return super().compose_node(parent, index)
        self._composed += 1
        if self._composed > MAX_NODES:
            raise LimitError(None, None, f"the recipe holds more than {MAX_NODES} values. Fix: a recipe needs a "
                             "few hundred; check that this is the right file", event.start_mark)
        if self._depth >= MAX_DEPTH:
            raise LimitError(None, None, f"nested more than {MAX_DEPTH} levels deep. Fix: a recipe needs a few "
                             "levels; check the brackets and the indentation", event.start_mark)
        self._depth += 1
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
        self._measure(node, event.start_mark)
        return node

    def _measure(self, node: Any, mark: Any) -> None:
        if isinstance(node, ScalarNode):
            values, chars, height = 1, len(node.value), 1
        else:
            children = [x for pair in node.value for x in pair] if isinstance(node, MappingNode) else node.value
            values, chars, height = 1, 0, 0
            for child in children:
                v, c, h = self._sizes[id(child)]
                values, chars, height = values + v, chars + c, max(height, h)
            height += 1
        self._sizes[id(node)] = (values, chars, height)
        if height > MAX_DEPTH:
            raise LimitError(None, None, f"nested more than {MAX_DEPTH} levels deep once its aliases are expanded. "
                             "Fix: write the values out, or alias less", mark)
        if values > MAX_NODES or chars > MAX_CHARS:
            raise LimitError(None, None, f"with its aliases expanded, this value holds {values} values and {chars} "
                             f"characters; a recipe may hold {MAX_NODES} and {MAX_CHARS}. Fix: write the values "
                             "out instead of aliasing aliases (an 'alias bomb' is refused)", mark)


def parse_yaml(text: str) -> Any:
    """``yaml.safe_load(text)`` within the bounds. Raises yaml.YAMLError (a LimitError over a bound; both carry
    ``problem_mark``) or TextError for a value YAML cannot build (``2024-13-01`` read as a date, ``!!int x``)."""
    loader = None
    try:
        loader = _BoundedLoader(text)  # its reader refuses control characters here already
        return loader.get_single_data()
    except yaml.reader.ReaderError as e:  # it has a position, not a mark
        line = text.count("\n", 0, e.position) + 1
        column = e.position - (text.rfind("\n", 0, e.position) + 1) + 1
        raise TextError(f"holds the character {chr(e.character)!r} at line {line}, column {column}, which YAML does "
                        "not allow (a control character). Fix: remove it") from None
    except (ValueError, TypeError, OverflowError) as e:
        raise TextError(f"holds a value YAML cannot build: {e}. Fix: quote it to make it a string") from None
    finally:
        if loader is not None:
            loader.dispose()


def yaml_error_message(e: yaml.YAMLError) -> str:
    """One line for a YAML error: what and where (line and column, counted from 1)."""
    mark = getattr(e, "problem_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "?"
    if isinstance(e, LimitError):
        return f"at {where}: {e.problem}"
    return f"not valid YAML at {where}: {getattr(e, 'problem', None) or e}"


def height(value: Any, limit: int = MAX_DEPTH + 1) -> int:
    """Nesting depth of lists and mappings in ``value`` (a scalar is 1), counted up to ``limit``."""
    if limit <= 0 or not isinstance(value, (dict, list)):
        return 1
    items = value.values() if isinstance(value, dict) else value
    return 1 + max((height(v, limit - 1) for v in items), default=0)


def encodable(text: str) -> bool:
    """Whether ``text`` can be written as UTF-8 (a lone surrogate, from argv's undecodable bytes, cannot)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
