"""What every run does on the host, whatever its architecture and algorithm.

`run_dir`: where a run's outputs go, and whether that directory starts a new run,
resumes one or holds a finished one. `storage`: a run directory that is a local
path or `gs://bucket/path`, read and written through `etils.epath`. `signals`:
SIGINT and SIGTERM before training starts end the process at once, cleanly.
"""
