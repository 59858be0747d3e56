"""Triton kernels (paged attention, copy+RoPE) with torch reference implementations."""
