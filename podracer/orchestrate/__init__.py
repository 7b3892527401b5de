"""Orchestrator: one run description becomes processes on hosts.

`cli`: the command line (flags onto config dataclasses, checks, dispatch to a
pair's trainer); `distributed`: spawning local processes and joining them with
`jax.distributed`.
"""
