"""simdist: an MPI-native simulator of distributed deep-learning training.

Each MPI rank hosts one simulated accelerator: the forward/backward math runs for real in
numba kernels on the CPU, while memory capacity, compute rate and links come from a device
profile. Importing the package pins one compute thread per rank, before numpy/numba load,
because several ranks share the host's cores and nested thread pools would oversubscribe it.
"""

import os

# Launchers pass these on to remote ranks too (simdist.launch).
THREAD_VARS = ("NUMBA_NUM_THREADS", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
for _var in THREAD_VARS:
    os.environ.setdefault(_var, "1")
# Ranks waiting in MPI yield the core instead of spinning (matters when oversubscribed).
os.environ.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")

__version__ = "0.1.0"
