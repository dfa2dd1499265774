"""`kill` of a bench stops like Ctrl-C, even when the signal lands inside a finalizer (where Python prints an
exception and drops it: a killed bench once left its whole region running that way)."""
import gc
import os
import signal
import time

import pytest

from bench.env import sigterm_as_interrupt


class KilledWhileCollected:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs here, inside __del__


def wait_a_little() -> None:
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        time.sleep(0.01)


@pytest.mark.parametrize("where", ["plain", "in_finalizer"])
def test_sigterm_interrupts(where):
    with pytest.raises(KeyboardInterrupt):
        with sigterm_as_interrupt():
            if where == "plain":
                os.kill(os.getpid(), signal.SIGTERM)
            else:
                KilledWhileCollected()  # dropped at once: __del__ runs now
                gc.collect()
            wait_a_little()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # restored


def test_no_interrupt_without_a_signal():
    with sigterm_as_interrupt():
        time.sleep(0.1)
