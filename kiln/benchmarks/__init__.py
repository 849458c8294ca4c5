"""Benchmarks: `kiln bench` (throughput, latency, compile, serve, startup) and the kernel and
profile scripts run as `python -m kiln.benchmarks.X`; each prints one JSON line, its baseline
measured in the same run."""
