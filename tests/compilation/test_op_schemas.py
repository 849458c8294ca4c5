"""Kiln's op schemas key Inductor's cache (kiln/compilation/op_schemas.py): a schema that changes
changes the key of stock Inductor (modes 1-2) and of Kiln's pass manager (mode 3)."""
from kiln.compilation import op_schemas
from kiln.compilation.passes import PostGradPassManager
from kiln.custom_ops import SCHEMAS


def test_a_changed_schema_changes_both_keys(monkeypatch):
    stock = op_schemas.stock_options("inductor")["post_grad_custom_post_pass"]
    manager = PostGradPassManager()
    before = stock.uuid(), manager.uuid()
    op_schemas.schemas_hash.cache_clear()
    monkeypatch.setattr("kiln.custom_ops.SCHEMAS", [*SCHEMAS[:-1], SCHEMAS[-1] + " "])
    try:
        after = stock.uuid(), manager.uuid()
    finally:
        monkeypatch.undo()
        op_schemas.schemas_hash.cache_clear()
    assert after[0] != before[0] and after[1] != before[1]
    assert (stock.uuid(), manager.uuid()) == before  # the registered schemas again
    assert op_schemas.stock_options("eager") is None  # Kiln's own backend keys itself
