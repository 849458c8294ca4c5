"""CUDA graphs: the modes and batch keys, the dispatcher choosing a graph per step, the wrapper
that records and replays, and the worker's capture step."""
