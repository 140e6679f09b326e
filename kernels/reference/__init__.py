"""Pure PyTorch twins of the jagged kernels: the default backend and the test oracle."""
