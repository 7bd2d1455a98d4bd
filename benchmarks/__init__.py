"""Benchmarks and measurement helpers for corp-deploy (real weights, compress cost, fidelity)."""
