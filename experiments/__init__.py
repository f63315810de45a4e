"""Experiments that drive the library from outside (not installed with the package)."""
