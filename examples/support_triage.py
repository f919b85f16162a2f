"""Learning proof 1: a support agent learns ticket routing from operator resolutions.

Tickets are generated from templates with a hidden correct team (payment,
delivery, technical, account); the simulated operator resolves a ticket
(reward 1.0) when the agent routed it to that team and escalates it (0.0)
otherwise. Every step: 16 training tickets through the gateway at
temperature 0.8, their resolutions through the feedback webhook, one
optimizer step by the service's own trainer. Held-out tickets (fillers never
used in training) are answered greedily before the first step, after step 10
and after step 20.

Run (3 seeds, serial single-tenant runs and the concurrent run; < 30 min per mode
on 2 CPU cores):

    python examples/support_triage.py --out docs/results/support --modes serial
    python examples/support_triage.py --out docs/results/support-concurrent --modes concurrent

Each writes <out>.json (every run), <out>.md (table) and <out>.png (curves);
`--replot` redraws from the JSON. Override any setting with `--set field=value`.
"""

from __future__ import annotations

import sys

from clora_feedback.cores import configure_waits

configure_waits()  # before torch loads, as every `clora` command does (see `cores`)

from clora_feedback.demo.experiment import ExperimentConfig  # noqa: E402
from clora_feedback.demo.proof import main  # noqa: E402

SUPPORT = ExperimentConfig(
    workload="support",
    steps=20,
    tasks_per_step=16,
    samples_per_task=1,
    eval_tasks=48,
    eval_every=10,
    temperature=0.8,
    rank=8,
)

if __name__ == "__main__":
    sys.exit(
        main(sys.argv[1:], SUPPORT, goal=0.9, title="Support triage: held-out routing accuracy")
    )
