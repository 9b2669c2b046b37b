"""Benchmarks of ampkernels against stock PyTorch, measured in the same run: ``python -m benchmarks --help``."""
