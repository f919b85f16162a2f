"""White-box benchmarks of engine and trainer internals, outside the installed package.

Each module is a program: `python -m benchmarks.<name> [--quick] [--json PATH]`
from the repository root prints its measured ratios as a Markdown table.

- `serve`: the embedded engine in process (mixed adapters, multiplexing, against
  transformers `generate()`, the gateway's overhead; `--decode-profile`: the
  decode step's parts, `decode_profile`);
- `train`: the continual trainer's costs (tenancy, swap, publish, staleness,
  interference with serving; `publish`, `staleness`);
- `precision`: training in bf16 compute against fp32;
- `fused_pass`: the training pass's fused pieces against the reference composites;
- `engine_ratio`: the trainer's logprobs against the embedded engine's on fresh samples;
- `prefix`: time to first token with the prefix cache on and off.

They reach into `engine`, `train` and `lora` internals on purpose (that is what
they measure), which is why they are not part of `clora_feedback`: the package's
own `clora bench ...` drives a running gateway from outside
(`clora_feedback.bench`). Their smoke tests live in `benchmarks/tests/`, collected
by the suite (`pyproject.toml` testpaths). Figures: `docs/benchmarks.md`.
"""

from __future__ import annotations

import sys

from clora_feedback.bench import apply_omp_wait_policy

if sys.argv[:1] == ["-m"]:  # `python -m benchmarks.X ...`: set before X imports torch
    apply_omp_wait_policy(sys.argv[1:])
