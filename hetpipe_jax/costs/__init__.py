"""The cost layer: cluster, profiles, cost model, all-reduce and fsdp costs, task times (numpy and scipy; no jax)."""
