"""`kiln::unified_attention` is an IR op, defined with its Python twin in kiln/ir/attention.py."""
from kiln.ir.attention import run_layer as unified_attention

__all__ = ["unified_attention"]
