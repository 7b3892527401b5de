"""Protocol: the only layer that knows devices, meshes, axis names and collectives.

`podracer.protocol.parallel` builds named meshes (`jax.make_mesh`), places arrays
on them, and wraps the collectives (`lax.pmean`, `psum`, `all_gather`) that
algorithms call with the axis names they are given.
"""
