"""The benchmarks' smoke tests run as the suite does: idle OpenMP threads sleep, not spin."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads
