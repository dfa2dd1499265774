"""The allocator's Redis scripts are files (processors/allocator/lua/); Python's constants reach them through a
generated prelude, so each is defined once."""
import pytest

from processors.allocator import lua
from processors.allocator.index import _LUA_LIBRARY, _READ_CHUNK, FIELDS, GENERATION, LIBRARY, LOST, READ, SUMMARY_OF


@pytest.mark.parametrize("name", ["project", "commit", "read", "outbox_done", "rename", "summary"])
def test_every_script_is_a_file_with_its_contract_at_the_top(name):
    first = lua.script(name).splitlines()[0]
    assert first.startswith("-- ") and ("ARGV" in first or "KEYS" in first)


def test_the_prelude_defines_the_constants_the_scripts_name():
    text = lua.script("commit", FIELDS=FIELDS, GENERATION=GENERATION, LOST=LOST)
    assert f"local GENERATION = '{GENERATION}'" in text and f"local LOST = '{LOST}'" in text
    assert "local FIELDS = {" + ", ".join(f"'{f}'" for f in FIELDS) + "}" in text
    assert "k(GENERATION)" in text and "return LOST" in text  # the script names them; Python defines them


@pytest.mark.parametrize("value", ["it's", "back\\slash", "new\nline"])
def test_a_constant_the_prelude_cannot_quote_is_refused(value):
    with pytest.raises(ValueError, match="quoting"):
        lua.script("read", X=value)


def test_the_readers_library_registers_each_function_read_only_with_its_bounds():
    assert _LUA_LIBRARY.startswith(f"#!lua name={LIBRARY}\n")
    for fn in (READ, SUMMARY_OF):
        assert (f"redis.register_function{{function_name='{fn}', callback={fn}, flags={{'no-writes'}}}}"
                in _LUA_LIBRARY)
    assert f"local MAX_READ = {_READ_CHUNK}" in _LUA_LIBRARY and f"local MAX_NAME = {lua.MAX_NAME}" in _LUA_LIBRARY
    assert _LUA_LIBRARY.count("if #P > MAX_NAME") == 2  # every function bounds the prefix it is given
