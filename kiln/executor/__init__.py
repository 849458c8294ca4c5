"""Executors: how the engine core reaches its workers (one in-process, one spawned process per
rank, or Ray actors), each step sent to every rank and their replies combined."""
