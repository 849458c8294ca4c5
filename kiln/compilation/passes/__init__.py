"""Post-grad FX passes run inside Inductor, managed by `PostGradPassManager`: the fusions on IR
ops, then the lowering of every IR op to its chosen implementation."""
from kiln.compilation.passes.fuse_rms_norm_linear import FuseAddRmsNormLinear
from kiln.compilation.passes.fuse_silu_mul_linear import FuseSiluMulLinear
from kiln.compilation.passes.lower_ir import LowerIrOps
from kiln.compilation.passes.pass_manager import KilnInductorPass, PostGradPassManager

__all__ = ["FuseAddRmsNormLinear", "FuseSiluMulLinear", "KilnInductorPass", "LowerIrOps",
           "PostGradPassManager"]
