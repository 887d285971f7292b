import os

# The benchmarks A/B the products' debug variants (probes, configurations, earlier forms) against
# the shipped kernels: build those too (engine/ops/build.py).
os.environ.setdefault("TRELLIS_DEBUG_VARIANTS", "1")
