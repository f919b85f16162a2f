"""Serving engines: the Engine Protocol, value types, the embedded torch engine and the vLLM engine."""
