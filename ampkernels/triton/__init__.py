"""Triton kernels of ampkernels (see ``multi_tensor``)."""
