"""hetpipe_jax: HetPipe (USENIX ATC'20) in JAX/Flax.

Two layers (see WORKSPACE.md): the planning layer (``schedule``, ``wsp``, ``cluster``, ``cost_model``,
``partitioner``, ``allocator``, ``plan_format``) imports only the standard library, numpy and scipy; the runtime
layer (``models``, ``stages``, ``pipeline``, ``transport``, ``param_server``, ``data``, ``train``) imports
jax/flax/optax/mpi4py.
"""

__version__ = "0.1.0"
