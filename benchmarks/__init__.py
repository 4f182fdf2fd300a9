"""Benchmarks of our own services (dev tooling; no product package imports this)."""
