"""Kiln's C kernels for CPU: sources in csrc/, built at first use (build.py), one Python entry
module per source."""
