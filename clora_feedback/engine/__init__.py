"""Serving engines: the Engine Protocol, value types and the embedded torch engine."""
