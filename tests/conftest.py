import jax
jax.config.update("jax_num_cpu_devices", 8)
