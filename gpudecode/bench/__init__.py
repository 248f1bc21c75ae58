"""Benchmarks (DESIGN §10): each measures our path and its baseline in the same run."""
