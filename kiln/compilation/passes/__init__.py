"""Post-grad FX passes run inside Inductor, managed by `PostGradPassManager`."""
from kiln.compilation.passes.pass_manager import KilnInductorPass, PostGradPassManager

__all__ = ["KilnInductorPass", "PostGradPassManager"]
