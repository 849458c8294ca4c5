"""Kiln's CPU kernels: C/C++ sources in csrc/, built at first use into one library of torch ops
(build.py), called as `torch.ops.kiln.*`; a Python module per kernel family says what it takes."""
