"""Attention kernels: Triton on CUDA, torch (and a fused C decode kernel) on the CPU."""
