"""streams/gc_control.py: the collector paused around a fold, restored after, the fold's objects frozen on request."""
import gc

import pytest

from streams.gc_control import GrowthFreezer, folding


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


def test_a_growing_state_is_frozen_each_time_it_grew_by_a_fifth():
    gc.unfreeze()
    try:
        freezer = GrowthFreezer()
        frozen = [n for n in (0, 5_000, 10_000, 11_000, 12_000, 12_001, 20_000, 23_999, 24_000) if freezer.grew(n)]
        assert frozen == [10_000, 12_000, 20_000, 24_000] and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
