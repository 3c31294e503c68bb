"""The parameter server: global weights, its MPI service loop and the wire protocol (numpy, mpi4py)."""
