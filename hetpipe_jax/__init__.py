"""hetpipe_jax: HetPipe (USENIX ATC'20) in JAX/Flax.

The folders are the layers (WORKSPACE.md). Pure (standard library, numpy, scipy; no jax, flax, optax, mpi4py or
orbax): ``rules`` (pipeline scheduling, WSP, partitions, records), ``planning`` (cluster, cost model, partitioner,
allocator, plan files), ``sim`` (event engine, traces) and ``data``. Runtime: ``models``, ``runtime`` (stages, the
virtual worker, stage executors, profiler), ``ps`` (parameter server, MPI service, wire protocol) and ``jobs``
(settings, the MPI and virtual-time jobs, outputs). Entry points: ``train``, ``plan``, ``simulate``.
"""

__version__ = "0.1.0"
