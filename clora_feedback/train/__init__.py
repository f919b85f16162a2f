"""Continual training: per-agent training state, losses, admission, publishing of adapter versions.

Modules: `state` (per-agent host-resident training state and the device slot),
`forward` and `loss` (the policy-gradient and supervised objectives),
`admission` (which rewarded samples go into a step), `trainer` (the loop),
`versions` (adapter version value types and the `AdapterStore` Protocol),
`artifact` (one version directory on disk), `registry` (the SQLite index of
versions and each agent's active pointer) and `cli` (`clora adapters ...`).
Judging versions (the offline gate and the canary, which replaced the
regression guard) is the release path's: `clora_feedback.release`.

Deliberately nothing is re-exported here, so importing one part never loads the others.
"""
