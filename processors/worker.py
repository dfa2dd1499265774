"""The loop shared by Ropewalk's confluent-kafka workers (Resource Broker, Health Check, agents):
`step()` until stopped by a signal (or a deadline), then `close()`. Each worker keeps its own start-up,
`step` and `close`; only the loop, the stop flag and the signal wiring live here.
"""
from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable

from streams.catchup import CatchUpStopped

log = logging.getLogger(__name__)


class LoopWorker:
    _stopping = False

    def step(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def loop(self, until: float | None = None) -> None:
        """Run `step()` until `stop()` (or the monotonic deadline `until`), then `close()`."""
        while not self._stopping and (until is None or time.monotonic() < until):
            self.step()
        self.close()

    def stop(self, *_) -> None:
        self._stopping = True

    def stopping(self) -> bool:
        """Whether a stop was asked (``read_to_end``'s ``stop``: a catch-up honours it too)."""
        return self._stopping

    def begin(self, start: Callable[[], object]) -> bool:
        """Run ``start`` (the worker's catch-up): True when it caught up; False when a stop came during it
        (``CatchUpStopped``): then nothing is decided from the partial fold and the worker is closed."""
        try:
            start()
        except CatchUpStopped as exc:
            log.info("%s; closing", exc)
            self.close()
            return False
        return True

    def stop_on_signals(self) -> None:
        """SIGTERM (`ropewalk down`) and SIGINT end the loop after the current step."""
        signal.signal(signal.SIGTERM, self.stop)
        signal.signal(signal.SIGINT, self.stop)


def close_clients(consumer, producer, log: logging.Logger, name: str, flush_s: float = 5.0) -> None:
    """Close a consumer (if any) and flush a producer, logging what the broker did not take."""
    if consumer is not None:
        consumer.close()
    try:
        producer.flush(flush_s)
    except Exception as exc:  # noqa: BLE001 - at exit, report and go
        log.warning("%s: flush at exit: %s", name, exc)
    producer.stop_following()
