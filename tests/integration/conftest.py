"""Every test under tests/integration is marked ``integration`` here, in one place (``-m "not integration"`` runs
the pure tests alone); a module does not mark itself."""
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):  # noqa: ARG001 - pytest's hook signature
    for item in items:
        if HERE in Path(item.fspath).resolve().parents:
            item.add_marker(pytest.mark.integration)
