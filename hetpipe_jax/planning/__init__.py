"""Cluster, profiles, cost model, partitioner, Nm, allocation, PS placement, plan files (no jax)."""
