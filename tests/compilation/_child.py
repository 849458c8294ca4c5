"""Child process for the cache tests: build the toy model on a cache dir, warm it up, report.

Usage: python _child.py <cache_dir> <out.pt> [<JSON of toy_config arguments>] (compile
sizes 1 and 8 unless the JSON names others); writes outputs, counters and the C++ builds
Inductor ran (compiles and preprocessing alike) to out.pt.
"""
import json
import sys

import torch
from torch._inductor import cpp_builder

from kiln.compilation.compile_state import compile_state_of
from kiln.compilation.counters import compilation_counter
from kiln.compilation.warmup import compile_and_warm_up
from kiln.entrypoints.cli.main import exit_without_teardown

import toy_model as tm

SIZES = [64, 8, 1, 3]

if __name__ == "__main__":
    cache_dir, out_path = sys.argv[1], sys.argv[2]
    builds, build = [], cpp_builder.CppBuilder.build
    cpp_builder.CppBuilder.build = lambda self: builds.append(self.get_command_line()) or build(self)
    fields = {"compile_sizes": [1, 8], **(json.loads(sys.argv[3]) if len(sys.argv) > 3 else {})}
    config = tm.toy_config(mode=3, cache_dir=cache_dir, **fields)
    model = tm.build(config)
    with torch.no_grad():
        compile_and_warm_up(lambda n: model(*tm.inputs(n)), config,
                            compile_state_of(model).warmup_phase)
        outputs = {n: model(*tm.inputs(n)) for n in SIZES}
    torch.save({"outputs": outputs, "counters": vars(compilation_counter.clone()),
                "cpp_builds": builds}, out_path)
    exit_without_teardown(0)  # as the CLI ends: torch's teardown took seconds per child
