import os

# 8 fake CPU devices for the pmap/sharding tests; must be set before jax is imported. The flag
# is added to any XLA_FLAGS already set (not only when there are none), and it touches only
# the host platform: on a GPU machine the default devices stay the GPUs.
_FAKE_DEVICES = "--xla_force_host_platform_device_count"
if _FAKE_DEVICES not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FAKE_DEVICES}=8".strip()
