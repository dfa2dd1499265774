"""The allocator's Redis scripts, each in its own ``.lua`` file here (read, and linted, as Lua).

``script(name, **constants)`` is the file's text, preceded by a prelude when ``constants`` are given: ``P`` (the
key prefix, ``ARGV[1]``), ``k(s)`` (a key under it), and each constant as a Lua local of the same name (a string,
a number, or a list of strings as a table), so a script names ``GENERATION`` or ``FIELDS`` and Python stays the one
place that defines them."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent


def script(name: str, **constants: str | int | Sequence[str]) -> str:
    text = (HERE / f"{name}.lua").read_text()
    if not constants:
        return text
    prelude = ["local P = ARGV[1]", "local function k(s) return P .. s end"]
    prelude += [f"local {key} = {_lua(value)}" for key, value in constants.items()]
    return "\n".join(prelude) + "\n" + text


def _lua(value: str | int | Sequence[str]) -> str:
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return _quoted(value)
    return "{" + ", ".join(_quoted(v) for v in value) + "}"


def _quoted(s: str) -> str:
    if any(c in s for c in "'\\\n"):
        raise ValueError(f"a Lua constant needs quoting rules this prelude does not have: {s!r}")
    return f"'{s}'"
