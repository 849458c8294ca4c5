"""The engine core: scheduling, paged KV cache bookkeeping, the schedule-execute-update loop.

Nothing here imports model code; tensors stay on the other side of the executor.
"""
