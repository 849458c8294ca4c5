"""Kiln's version string (part of the compile cache key)."""
__version__ = "0.1.0"
