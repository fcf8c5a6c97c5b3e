"""python -m lintrans.ops.native: build the native kernels now (``make install`` does) and print where."""
from . import build

print(build(verbose=True))
