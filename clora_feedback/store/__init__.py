"""Durable storage: trajectories (SQLite, WAL)."""
