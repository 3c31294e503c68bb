"""Partitioner, Nm, allocation (NP / ED / HD / auto), PS placement, plan files and their task times (no jax)."""
