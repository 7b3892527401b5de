"""Environments as both architectures know them, below both: their spaces (`spec`) and
which library runs an id (`ids`)."""
