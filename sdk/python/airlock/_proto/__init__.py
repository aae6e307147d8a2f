"""Stubs generated from proto/airlock.proto when the package is built (see setup.py)."""
