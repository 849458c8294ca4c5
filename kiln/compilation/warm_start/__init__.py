"""Warm starts without Dynamo: the cold trace's split graph saved beside its compiled artifacts
(graph_cache.py, graph_pickle.py) and rebuilt by a later process (`WarmStart`)."""
from kiln.compilation.warm_start.warm_start import SavedGraph, WarmStart

__all__ = ["SavedGraph", "WarmStart"]
