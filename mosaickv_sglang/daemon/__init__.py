"""The CPU recompression daemon and the between-step swap (heterogeneous double buffer).

New pages live in the pool's hot buffer and are read from there; a full page is copied into a
shared-memory slot (`channel`) and sealed by a worker process (`worker`) that the scheduler-side
`client` starts, feeds, watches and restarts; finished pages are installed at one point of the
scheduler loop, the same on every TP rank (`adopt`). Nothing here imports SGLang.
"""
