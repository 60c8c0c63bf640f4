"""Triton PagedAttention kernels and their pure-PyTorch references."""
