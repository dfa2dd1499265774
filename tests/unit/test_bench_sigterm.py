"""`kill` of a bench stops like Ctrl-C, even when the signal lands inside a finalizer or a gc callback (where Python
prints an exception and drops it: a killed bench once left its whole region running that way, and CI once saw the
re-delivered signal land in a gc callback of hypothesis's)."""
import gc
import os
import signal
import sys
import time

import pytest

from bench.env import sigterm_as_interrupt


class KilledWhileCollected:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs here, inside __del__


def kill_in_gc_callback(phase, info):
    if phase == "start":
        gc.callbacks.remove(kill_in_gc_callback)
        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs here, inside the gc callback


def wait_a_little() -> None:
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        time.sleep(0.01)


@pytest.mark.parametrize("where", ["plain", "in_finalizer", "in_gc_callback"])
def test_sigterm_interrupts(where):
    hook_before = sys.unraisablehook
    with pytest.raises(KeyboardInterrupt):
        with sigterm_as_interrupt():
            if where == "plain":
                os.kill(os.getpid(), signal.SIGTERM)
            elif where == "in_finalizer":
                KilledWhileCollected()  # dropped at once: __del__ runs now
                gc.collect()
            else:
                gc.callbacks.append(kill_in_gc_callback)
                gc.collect()
            wait_a_little()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # restored
    assert sys.unraisablehook is hook_before


def test_no_interrupt_without_a_signal():
    with sigterm_as_interrupt():
        time.sleep(0.1)
