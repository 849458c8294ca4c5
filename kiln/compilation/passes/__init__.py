"""Post-grad FX passes run inside Inductor, managed by `PostGradPassManager`: no-op elimination
and the quant fusions, the fusions on IR ops into linears, then the lowering of every IR op to
its chosen implementation."""
from kiln.compilation.passes.early_passes import early_passes
from kiln.compilation.passes.eliminate_noops import EliminateNoops
from kiln.compilation.passes.fuse_act_quant import FuseActQuant
from kiln.compilation.passes.fuse_norm_quant import FuseNormQuant
from kiln.compilation.passes.fuse_rms_norm_linear import FuseAddRmsNormLinear
from kiln.compilation.passes.fuse_silu_mul_linear import FuseSiluMulLinear
from kiln.compilation.passes.lower_ir import LowerIrOps
from kiln.compilation.passes.pass_manager import KilnInductorPass, PostGradPassManager

__all__ = ["EliminateNoops", "FuseActQuant", "FuseAddRmsNormLinear", "FuseNormQuant",
           "FuseSiluMulLinear", "KilnInductorPass", "LowerIrOps", "PostGradPassManager",
           "early_passes"]
