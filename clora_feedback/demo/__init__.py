"""Simulated users and workloads that show the loop learning: the demo and the experiments."""
