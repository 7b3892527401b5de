"""What every run does on the host, whatever its architecture and algorithm.

`run_dir`: where a run's outputs go, and whether that directory starts a new run,
resumes one or holds a finished one (local or `gs://`, through `podracer.storage`). `signals`:
SIGINT and SIGTERM before training starts end the process at once, cleanly.
"""
