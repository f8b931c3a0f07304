"""Benchmarks: each drives the rooms it measures from above (`pdlab bench NAME`), so none imports upward."""
