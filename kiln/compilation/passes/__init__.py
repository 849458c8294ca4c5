"""Post-grad FX passes run inside Inductor, managed by `PostGradPassManager`: no-op elimination
and the quant fusions, the fusions on IR ops into linears, the lowering of every IR op to its
chosen implementation, then the in-place forms of lowered ops where the graph owns their inputs."""
from kiln.compilation.passes.early_passes import early_passes, late_passes
from kiln.compilation.passes.eliminate_noops import EliminateNoops
from kiln.compilation.passes.fuse_act_quant import FuseActQuant
from kiln.compilation.passes.fuse_mm_act_quant import FuseMmActQuant
from kiln.compilation.passes.fuse_norm_quant import FuseNormQuant
from kiln.compilation.passes.fuse_rms_norm_linear import FuseAddRmsNormLinear
from kiln.compilation.passes.fuse_silu_mul_linear import FuseSiluMulLinear
from kiln.compilation.passes.lower_ir import LowerIrOps
from kiln.compilation.passes.pass_manager import KilnInductorPass, PostGradPassManager
from kiln.compilation.passes.reinplace_ir_ops import ReinplaceIrOps

__all__ = ["EliminateNoops", "FuseActQuant", "FuseAddRmsNormLinear", "FuseMmActQuant",
           "FuseNormQuant", "FuseSiluMulLinear", "KilnInductorPass", "LowerIrOps", "PostGradPassManager",
           "ReinplaceIrOps", "early_passes", "late_passes"]
