"""The allocator's Redis scripts, each in its own ``.lua`` file here (read, and linted, as Lua).

``script(name, **constants)`` is the file's text, preceded by a prelude when ``constants`` are given: ``P`` (the
key prefix, ``ARGV[1]``), ``k(s)`` (a key under it), and each constant as a Lua local of the same name (a string,
a number, or a list of strings as a table), so a script names ``GENERATION`` or ``FIELDS`` and Python stays the one
place that defines them.

``library(name, functions, **constants)`` is a Redis 7 function library (``FUNCTION LOAD``) of read-only functions
(flag ``no-writes``: ``FCALL_RO``), each a file's text as a function's body, with the same prelude inside it (``P``
and ``k`` from its ``ARGV[1]``; the constants). Each function refuses a ``P`` of more than ``MAX_NAME`` bytes. The
readers of the index run these and nothing else (infra/credentials.py: their Redis users may not EVAL)."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
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


MAX_NAME = 256  # bytes of a prefix or a machine id a library function takes (a caller's strings bound its work)


def library(name: str, functions: Mapping[str, str], **constants: str | int | Sequence[str]) -> str:
    """The Lua source of function library ``name``: ``functions`` maps each function's name to its ``.lua`` file."""
    lines = [f"#!lua name={name}", f"local MAX_NAME = {MAX_NAME}"]
    lines += [f"local {key} = {_lua(value)}" for key, value in constants.items()]
    for fname, file in functions.items():
        lines += [f"local function {fname}(KEYS, ARGV)", "  local P = ARGV[1] or ''",
                  "  if #P > MAX_NAME then return redis.error_reply('ERR a prefix longer than ' .. MAX_NAME .. "
                  "' bytes') end", "  local function k(s) return P .. s end",
                  (HERE / f"{file}.lua").read_text(), "end",
                  f"redis.register_function{{function_name='{fname}', callback={fname}, flags={{'no-writes'}}}}"]
    return "\n".join(lines) + "\n"
