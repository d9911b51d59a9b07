"""Latency benchmarks per device type (`k2deploy bench` and `k2deploy bench compare`), and parity: an artifact
against the eager reference of its checkpoint (`parity.py`)."""
