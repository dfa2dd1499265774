"""The Python side's enum symbols (streams/enums.py) are the schemas' (schemas/*.avsc): a symbol added, renamed or
reordered in one place fails here until the other follows. And no module of the control plane writes a symbol's
value again at module level (``UP = "UP"``): it takes it from streams/enums.py."""
import ast
import json
from pathlib import Path

import pytest

from streams import enums

ROOT = Path(__file__).resolve().parents[2]


def avro_enums() -> dict[str, tuple[str, ...]]:
    found: dict[str, tuple[str, ...]] = {}

    def walk(node):
        if isinstance(node, dict):
            if node.get("type") == "enum":
                assert found.setdefault(node["name"], tuple(node["symbols"])) == tuple(node["symbols"]), node["name"]
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    for path in sorted((ROOT / "schemas").glob("*.avsc")):
        walk(json.loads(path.read_text()))
    return found


def test_every_avro_enum_has_its_class():
    assert sorted(avro_enums()) == sorted(cls.__name__ for cls in enums.ENUMS)


@pytest.mark.parametrize("cls", enums.ENUMS, ids=lambda c: c.__name__)
def test_symbols_are_the_schemas(cls):
    assert enums.symbols(cls) == avro_enums()[cls.__name__]
    assert all(getattr(cls, s) == s for s in enums.symbols(cls))


ALL_SYMBOLS = {s for cls in enums.ENUMS for s in enums.symbols(cls)}


def module_level_symbols(path: Path) -> list[str]:
    """``NAME = "<an enum symbol>"`` at the module level of ``path``."""
    out = []
    for node in ast.parse(path.read_text()).body:
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
                and node.value.value in ALL_SYMBOLS):
            out += [f"{path.relative_to(ROOT)}:{node.lineno}: {t.id} = {node.value.value!r}"
                    for t in node.targets if isinstance(t, ast.Name)]
    return out


def test_no_module_writes_a_symbol_again():
    found = [hit for pkg in ("processors", "streams", "bench") for path in sorted((ROOT / pkg).rglob("*.py"))
             if path.name != "enums.py" for hit in module_level_symbols(path)]
    assert found == []
