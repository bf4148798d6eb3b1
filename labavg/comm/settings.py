"""The choices of the comm layer a run's settings name (torch-free, for the settings schema)."""

BACKENDS = ("inproc", "mpi", "torch")
# How the ranks compute the mean of their parameters (labavg.comm.reduce, docs/averaging.md).
REDUCE = ("allreduce", "butterfly", "ring")
