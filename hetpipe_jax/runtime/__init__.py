"""What runs on devices: stages, the virtual worker's scheduler, stage executors, profiler (jax)."""
