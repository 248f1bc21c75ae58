"""Benchmarks (docs/performance.md): each measures our path and its baseline in the same run."""
