"""Datasets: Fashion-MNIST IDX loading, per-VW sharding and minibatch order, synthetic files (no jax)."""
