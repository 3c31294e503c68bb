"""The pure rules every mode calls: pipeline scheduling, WSP, partitions, records (planning layer: no jax)."""
