"""Latency benchmarks per device type: `k2deploy bench` and `k2deploy bench compare`."""
