"""The passes that run before the IR-op-into-linear fusions and the lowering, each named in
`pass_config` with vLLM's name and on unless set false there: `eliminate_noops`,
`fuse_norm_quant`, `fuse_act_quant`, `fuse_mm_act_quant` (the last three match only W8A8 int8
models' graphs, the last one after `fuse_act_quant`); and the one after the lowering,
`reinplace_ir_ops`.
"""
from kiln.compilation.passes.eliminate_noops import EliminateNoops
from kiln.compilation.passes.fuse_act_quant import FuseActQuant
from kiln.compilation.passes.fuse_mm_act_quant import FuseMmActQuant
from kiln.compilation.passes.fuse_norm_quant import FuseNormQuant
from kiln.compilation.passes.reinplace_ir_ops import ReinplaceIrOps

PASSES = {"eliminate_noops": EliminateNoops, "fuse_norm_quant": FuseNormQuant,
          "fuse_act_quant": FuseActQuant, "fuse_mm_act_quant": FuseMmActQuant}


def enabled(pass_config: dict, name: str) -> bool:
    return pass_config.get(name, True)  # checked by CompilationConfig (PASS_NAMES)


def early_passes(kiln_config) -> list:
    pass_config = kiln_config.compilation_config.pass_config
    return [cls() for name, cls in PASSES.items() if enabled(pass_config, name)]


# After the lowering, likewise named in pass_config and on by default.
LATE_PASSES = {"reinplace_ir_ops": ReinplaceIrOps}


def late_passes(kiln_config) -> list:
    pass_config = kiln_config.compilation_config.pass_config
    return [cls() for name, cls in LATE_PASSES.items() if enabled(pass_config, name)]
