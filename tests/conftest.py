import os

# Eight fake CPU devices for the sharding tests; must precede `import jax`.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
