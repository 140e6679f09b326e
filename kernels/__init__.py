"""gemline stage: kernels."""
