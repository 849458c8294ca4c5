"""Post-grad FX passes run inside Inductor, managed by `PostGradPassManager`."""
from kiln.compilation.passes.fuse_rms_norm_linear import FuseAddRmsNormLinear
from kiln.compilation.passes.fuse_silu_mul_linear import FuseSiluMulLinear
from kiln.compilation.passes.pass_manager import KilnInductorPass, PostGradPassManager

__all__ = ["FuseAddRmsNormLinear", "FuseSiluMulLinear", "KilnInductorPass",
           "PostGradPassManager"]
