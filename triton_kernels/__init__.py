"""Triton backend (installed as kvkernels.triton_kernels). Same signatures as kvkernels.reference.

Runs on CUDA, and on CPU under TRITON_INTERPRET=1, which is how CI tests it.
"""
