"""Ropewalk's benchmarks.

``ropewalk bench`` (``bench/harness.py``) runs the whole-pipeline harness of issue #5 on an embedded broker,
Redis and control plane of its own; ``ropewalk experiment`` runs the paper's experiments (``bench/experiments/``)
and the kill storm (``bench/killstorm.py``); the CLI runs both as this package's program (``bench/cli.py``). The
scripts beside them (``log_rates.py``, ``replay_rate.py``,
``archive_rate.py``, ``fastplace_rate.py``, ``transactions.py``, ``faust_overhead.py``) are the narrower
benchmarks whose
numbers are in BENCHMARKS.md. Benchmarks are not tests: CI runs the harness at a smoke size only.
"""
