"""Lines of generated code wrapped at `WIDTH` columns, the way a person would.

A statement that ends in a call or a bracketed literal is broken inside its last bracket:
the opening line keeps everything up to the bracket, the arguments follow one level
deeper, packed as many to a line as fit, and the bracket closes on a line of its own::

    self.add_param(
        'gpt_wte_weight', 'gpt.wte.weight', shape=(128, 64), index=((0, 64), (0, 64)),
        dtype=torch.float32, holders=(0,))

An argument still too long is broken the same way, one level deeper. A comment is
continued on the next line (``#   ...``). Lines inside triple-quoted strings (docstrings,
the pipeline's schedule) are left alone: their writers wrap them.
"""

from __future__ import annotations

import functools
import re
import textwrap

#: The widest line generated code writes.
WIDTH = 100
_INDENT = "    "
_OPEN = {"(": ")", "[": "]", "{": "}"}


_MARK = re.compile(r"[()\[\]{},]")
#: A string literal (to its closing quote, or to the end of the text: a backslash escapes
#: the next character), a comment's ``#``, or a bracket or comma.
_TOKEN = re.compile(
    r"""'''(?:\\[\s\S]?|[^\\])*?(?:'''|\Z)|\"\"\"(?:\\[\s\S]?|[^\\])*?(?:\"\"\"|\Z)"""
    r"""|'(?:\\[\s\S]?|[^'\\])*(?:'|\Z)|"(?:\\[\s\S]?|[^"\\])*(?:"|\Z)|[#()\[\]{},]""")


def _scan(text: str) -> list[tuple[int, str]]:
    """The positions of brackets and commas outside string literals: ``(pos, char)``.
    Found by ``re`` (a Python step per character was most of the time of wrapping the long
    lines of large programs)."""
    if "'" not in text and '"' not in text and "#" not in text:
        return [(m.start(), m.group()) for m in _MARK.finditer(text)]
    out: list[tuple[int, str]] = []
    for m in _TOKEN.finditer(text):
        c = m.group()[0]
        if c == "#":
            break
        if c != "'" and c != '"':
            out.append((m.start(), c))
    return out


def _split_last_bracket(text: str) -> tuple[str, list[str], str] | None:
    """``(head, args, close)``: ``text`` ends with a bracket that closes the one at the
    end of ``head``; ``args`` are its top-level items. None when it does not."""
    marks = _scan(text)
    if not marks or marks[-1][1] not in ")]}" or marks[-1][0] != len(text) - 1:
        return None
    depth = 0
    commas: list[int] = []
    for pos, c in reversed(marks):
        if c in ")]}":
            depth += 1
        elif c in "([{":
            depth -= 1
            if depth == 0:
                start = pos
                break
        elif c == "," and depth == 1:
            commas.append(pos)
    else:
        return None
    inner = text[start + 1:-1]
    if not inner.strip():
        return None
    cuts = [start] + sorted(commas) + [len(text) - 1]
    args = [text[a + 1:b].strip() for a, b in zip(cuts, cuts[1:])]
    if not args[-1]:  # a trailing comma, as in the tuple (0,): it stays
        args = args[:-1]
        args[-1] += ","
    return text[:start + 1], args, text[-1]


def _pack(indent: str, args: list[str], width: int) -> list[str]:
    """``args`` (each followed by a comma but the last) packed into lines of ``width``."""
    lines: list[str] = []
    current = ""
    for k, arg in enumerate(args):
        item = arg if k == len(args) - 1 else arg + ","
        if current and len(indent) + len(current) + 1 + len(item) <= width:
            current += " " + item
        else:
            if current:
                lines.append(indent + current)
            current = item
    if current:
        lines.append(indent + current)
    return lines


def wrap_code(line: str, width: int = WIDTH) -> list[str]:
    """One line of code as lines of at most ``width`` columns where it can be broken."""
    if len(line) <= width:
        return [line]
    return list(_wrap_long(line, width))


@functools.lru_cache(maxsize=4096)
def _wrap_long(line: str, width: int) -> tuple[str, ...]:
    """`wrap_code` of a line longer than ``width``, remembered: the files of a large
    program repeat many long lines (the holders of a parameter, in every rank's file)."""
    body = line.lstrip(" ")
    indent = line[:len(line) - len(body)]
    if body.startswith("#"):
        return tuple(textwrap.wrap(body, width=width, initial_indent=indent,
                                   subsequent_indent=indent + "#   ",
                                   break_long_words=False, break_on_hyphens=False) or [line])
    trailing = ""
    if body.endswith(","):
        body, trailing = body[:-1], ","
    parts = _split_last_bracket(body)
    if parts is None:
        return (line,)
    head, args, close = parts
    inner_indent = indent + _INDENT
    out = [indent + head]
    for packed in _pack(inner_indent, args, width):
        out += wrap_code(packed, width)
    out[-1] += close + trailing
    if len(out[-1]) > width:  # the closing bracket did not fit: its own line
        out[-1] = out[-1][:-len(close + trailing)]
        out.append(indent + close + trailing)
    return tuple(out)


def wrap_lines(lines: list[str], width: int = WIDTH) -> list[str]:
    """Every line of a generated file wrapped (see the module docstring)."""
    out: list[str] = []
    in_string = False
    for line in lines:
        quotes = line.count('"""')
        if in_string or quotes:
            out.append(line)
            if quotes % 2:
                in_string = not in_string
            continue
        out += wrap_code(line, width)
    return out


def unwrap(source: str) -> str:
    """``source`` with every wrapped statement and comment back on one line (what the
    file would read without `wrap_lines`): for tools and tests that match lines."""
    out: list[str] = []
    depth = 0
    in_string = False
    for line in source.split("\n"):
        if in_string or (depth == 0 and line.count('"""')):
            out.append(line)
            if line.count('"""') % 2:
                in_string = not in_string
            continue
        body = line.strip()
        if depth > 0:
            prev = out[-1]
            glue = "" if prev.endswith(tuple(_OPEN)) or body[:1] in (")", "]", "}") else " "
            out[-1] = prev + glue + body
        elif (body.startswith("#   ") and out and out[-1].lstrip().startswith("#")
              and len(out[-1]) - len(out[-1].lstrip()) == len(line) - len(line.lstrip())):
            out[-1] = out[-1] + " " + body[4:]
            continue
        else:
            out.append(line)
        for _, c in _scan(body):
            if c in _OPEN:
                depth += 1
            elif c in ")]}":
                depth -= 1
    return "\n".join(out)
