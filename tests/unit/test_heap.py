"""streams/heap.py: the collector paused around a fold, restored after, the fold's objects frozen on request."""
import gc

import pytest

from streams.heap import folding


@pytest.mark.parametrize("enabled", [True, False])
@pytest.mark.parametrize("freeze", [True, False])
def test_folding_pauses_the_collector_and_restores_it(enabled, freeze):
    (gc.enable if enabled else gc.disable)()
    gc.unfreeze()
    try:
        with folding(freeze=freeze):
            assert not gc.isenabled()
            held = [[i] for i in range(1000)]  # long-lived state built by the fold
        assert gc.isenabled() is enabled
        assert (gc.get_freeze_count() >= len(held)) is freeze
    finally:
        gc.unfreeze()
        gc.enable()


def test_the_collector_is_restored_when_the_fold_fails():
    with pytest.raises(RuntimeError):
        with folding(freeze=False):
            raise RuntimeError("the broker went away")
    assert gc.isenabled()
