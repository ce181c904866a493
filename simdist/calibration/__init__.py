"""Measuring this machine for the ``host`` device profile (``python -m simdist.calibrate``).

``compute``: GEMM, elementwise, scalar and memory sweeps of one thread; ``link``: the MPI
link and shared-memory peer access as the collectives use them (``LinkProbe``), and their
fits; ``render``: the profile YAML with a comment per number. What is measured and why is
described in ``simdist.calibrate``, the command. These modules import numba and (the link
probes) MPI, which ``simdist.device``'s cost code does not.
"""
