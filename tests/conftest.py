import simdist  # noqa: F401  (pins one compute thread per process before numpy loads)
