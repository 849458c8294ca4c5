"""The front end's check of a structured-outputs spec remembers results, but a server that saw
many distinct big schemas must not keep their text: a schema of megabytes fits in one body."""
import gc
import tracemalloc

import pytest

from kiln.sampling_params import StructuredOutputsParams
from kiln.structured_output.xgrammar_backend import check_structured_outputs


def test_checking_distinct_big_schemas_keeps_none_of_them():
    check_structured_outputs(StructuredOutputsParams(json={"type": "object"}))  # import, warm
    tracemalloc.start()
    try:
        gc.collect()
        before = tracemalloc.get_traced_memory()[0]
        for i in range(12):
            schema = {"type": "object", "description": f"{i}" + "x" * 500_000,
                      "properties": {"a": {"type": "integer"}}}
            check_structured_outputs(StructuredOutputsParams(json=schema))
        del schema
        gc.collect()
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert kept < 1_000_000, f"{kept / 1e6:.1f} MB kept after 12 distinct 0.5 MB schemas"


def test_a_big_bad_schema_is_still_refused():
    schema = {"type": "object", "description": "x" * 100_000, "properties": {"a": {"type": 5}}}
    with pytest.raises(ValueError, match="structured_outputs.json"):
        check_structured_outputs(StructuredOutputsParams(json=schema))
