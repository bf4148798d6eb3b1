# ipyparallel profile config for labavg on Slurm: MPI engines started by MPICH's hydra mpiexec,
# which starts one engine per Slurm task on every node of the allocation (through srun).
# labavg-cluster.sbatch copies this file into $IPYTHONDIR/profile_labavg/. ipcluster reads it as
# ordinary ipyparallel configuration (this is IPython's config format; labavg never loads it).
import os
import sys

c = get_config()  # noqa: F821 - provided by IPython's config loader

c.Cluster.engine_launcher_class = "mpi"
# The venv's MPICH (the same one mpi4py was built against), as labavg.comm.launchers.find_mpiexec.
c.MPIEngineSetLauncher.mpi_cmd = [os.path.join(os.path.dirname(sys.executable), "mpiexec")]
# "-launcher slurm": hydra starts its proxies with srun inside the allocation (no ssh).
# Rank traffic must use a network every node reaches, so no loopback settings here; pick the
# interface (or provider) of the cluster network. LABAVG_FI_IFACE is set by the sbatch script.
c.MPIEngineSetLauncher.mpi_args = [
    "-launcher", "slurm",
    "-genv", "FI_PROVIDER", os.environ.get("LABAVG_FI_PROVIDER", "tcp"),
    "-genv", "FI_TCP_IFACE", os.environ.get("LABAVG_FI_IFACE", "eth0"),
]
# Engines find the controller at the head node's cluster-network address (set with --ip).
c.Cluster.engine_timeout = 300  # many engines importing torch from a shared file system is slow
