"""Whole jobs: settings (pure), the MPI job, the virtual-time job, outputs, evaluation, checkpoints."""
