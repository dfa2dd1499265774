"""How a long run of the library says how far it is: a plain callable ``progress(what, done=None, total=None)``
(``what`` names the phase; ``done``/``total`` count its records, ``total`` None when not known). The front end
passes ``processors/frontend/console.Progress``, which draws it on a terminal (rich) or says one line per phase;
``silent`` is the default. Callers call it at most once per batch, never per record."""
from __future__ import annotations

from typing import Callable, Optional

ProgressFn = Callable[..., None]  # (what: str, done: int | None = None, total: int | None = None) -> None


def silent(what: str, done: Optional[int] = None, total: Optional[int] = None) -> None:  # noqa: ARG001 - the signature
    """No progress shown."""
