"""Communication between ranks. The only package that imports mpi4py or torch.distributed."""
