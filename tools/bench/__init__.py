"""Benchmark programs: kernels, steps, verification cost, training speed, host syncs, drafters over prompt streams."""
