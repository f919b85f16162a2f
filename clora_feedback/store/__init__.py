"""Durable storage: the adapter registry and its version directories, trajectories, leases.

One database seam (`db`: SQLite in WAL mode, or PostgreSQL shared by every
process) under three owners: the adapter registry (`registry/`, with the
immutable version directories of `artifact` and `versions`, base identity in
`provenance`, retention in `retention`, pointer notifications in `notify`),
the trajectory store (`trajectories`, tables in `trajectory_tables`), and the
trainer leases (`lease`). `migrate` copies a SQLite store into PostgreSQL.

Not here: the feedback store (`clora_feedback.feedback.store`), which joins
feedback to the trajectories read through `TrajectoryReader`.
"""
