"""Triton twins of the jagged kernels (each op: kernels + one autograd.Function).

Importing this package imports triton; the dispatchers import it lazily. Kernels
accumulate in float32 and cast on store; all token/row index arithmetic is int64.
"""
