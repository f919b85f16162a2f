"""Adapters that connect agent frameworks to clora-feedback (each imports its framework lazily)."""
