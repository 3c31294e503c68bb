"""hetpipe_jax: HetPipe (USENIX ATC'20) in JAX/Flax.

The folders are the layers, one downward stack (``.importlinter``; each imports only those below it): the entry
points ``train``, ``launch``, ``plan``, ``simulate``, ``compare`` > ``jobs`` (settings, the MPI and virtual-time jobs,
outputs), ``profiles`` > ``runtime`` (stages, the virtual worker, stage executors, profiler) > ``ps`` (parameter
server, MPI service, wire protocol) > ``models``, ``data`` > ``planning`` (partitioner, Nm, allocation, plan files)
> ``sim`` (event engine and what runs it, traces) > ``costs`` (cluster, profiles, cost model, task times) > ``rules``
(pipeline scheduling, WSP, methods, partitions, records) > ``paths``, ``rank_devices``, ``host_timers``. Pure
(standard library, numpy, scipy; no jax, flax, optax, mpi4py or orbax): ``rules``, ``costs``, ``sim``, ``planning``
and ``data``.
"""

__version__ = "0.1.0"
