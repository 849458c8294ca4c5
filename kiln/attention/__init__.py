"""Attention backends behind one interface; the portable one is plain torch (CPU and GPU)."""
