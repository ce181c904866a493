"""Numba kernels for simdist, installed as ``simdist.kernels``.

Conventions (every kernel module follows them):
- one ``<op>_forward`` / ``<op>_backward`` pair per op, returning nothing and writing into
  caller-provided float32 buffers in the order: outputs, saved statistics, inputs,
  parameters, then scalars;
- no allocation inside a kernel (``np.dot(a, b, out)`` writes through BLAS, beta = 0),
  except ``blas.gemm`` packing its operands into half-precision temporaries in mixed precision;
- backward kernels overwrite the parameter gradients they produce (gradient accumulation
  across micro-batches happens on flat buffers, outside the kernels) unless the name says
  ``accumulate``; input gradients are overwritten;
- float32 throughout: constants are ``np.float32``; no float64 arithmetic leaks;
- all jit options live in ``_jit.py`` (numba's cache key ignores them).
"""
