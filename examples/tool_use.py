"""Learning proof 2 (the C-LoRA workload): arithmetic word problems with calculator and final_answer.

GSM8K-style problems generated in code; the agent calls `calculator` and
`final_answer` through the OpenAI tools API (`tool_choice="required"`, at
most two turns); the answer checker sends reward 1.0 only when
`final_answer` carries the right number, 0.0 otherwise, for every completion
of the episode; for a failed episode the simulated developer also corrects
the first wrong turn (the call it should have made) through the webhook.
Held-out problems (names and objects never used in training) are solved
greedily before, midway and after.

Run (3 seeds; each mode < 30 min on 2 CPU cores):

    python examples/tool_use.py --out docs/results/tool-use --modes serial
    python examples/tool_use.py --out docs/results/tool-use-concurrent --modes concurrent
"""

from __future__ import annotations

import sys

from clora_feedback.cores import configure_waits

configure_waits()  # before torch loads, as every `clora` command does (see `cores`)

from clora_feedback.demo.experiment import ExperimentConfig  # noqa: E402
from clora_feedback.demo.proof import main  # noqa: E402

TOOL_USE = ExperimentConfig(
    workload="tool-use",
    steps=20,
    tasks_per_step=2,
    samples_per_task=1,
    eval_tasks=16,
    eval_every=10,
    temperature=0.8,
    rank=8,
    corrections=True,
)

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], TOOL_USE, goal=None, title="Tool use: held-out accuracy"))
