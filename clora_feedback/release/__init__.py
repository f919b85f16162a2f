"""Releases: a trainer's candidate versions reach serving only through an offline gate and a canary.

`stats` (the paired bound and the sequential test), `evalset` (each agent's held-out
evaluation cases and the split that keeps them out of training), `gate` (candidate and
serving answer the same cases), `canary` (sticky arm choice, the live comparison), `arms`
(the engine names of the extra arms), `controller` (the background component that moves
versions through their states). The life of a version is drawn in `docs/release.md`.

Not here: the registry's storage of the states (`store.registry.releases`), HTTP.
"""
