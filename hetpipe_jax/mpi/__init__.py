"""The MPI-facing code: rank layout, per-rank device table, one wire format, PS client/server and stage ranks.

``rank_layout`` (which rank runs what, on which host) and ``rank_devices`` (the launcher's per-rank GPU table) are
pure (standard library) and ``wire`` (one header codec, message kinds, ``ProtocolError``, the poll back-off) needs
only numpy: the launcher and the job's checks import them without mpi4py or jax. ``ps_client`` / ``ps_server`` /
``ps_shards`` carry the parameter server over MPI (the in-process PS, :mod:`hetpipe_jax.ps`, is the layer below);
``stage_link`` / ``stage_client`` / ``stage_server`` carry a VW's stages on separate ranks. mpi4py is imported where
a communicator is first used, never at import time.
"""
