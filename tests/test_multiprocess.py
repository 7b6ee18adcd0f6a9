"""Ring attention across 2 processes on loopback with jax.distributed.

The test starts this file twice as a worker; each worker checks its part of the result against
the reference under the accuracy rule. On CPU (CPU collectives, gloo) each worker has 2 CPU
devices, a ring of 4 over 2 processes, in float32. On a machine with 2+ GPUs the same runs with
half of the GPUs per worker (NCCL, bfloat16, the CUDA kernels); with fewer it skips.
"""

import os
import socket
import subprocess
import sys

import pytest

UNAVAILABLE = 77  # a worker's exit code when the CPU collectives backend is missing
TIMEOUT_S = 240


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _worker(process_id, port, platform):
  import functools

  import jax
  if platform == "cpu":
    try:
      jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except Exception as e:  # this jaxlib has no CPU collectives backend
      print(f"gloo CPU collectives unavailable: {e}")
      sys.exit(UNAVAILABLE)
  jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id,
                             initialization_timeout=60)
  import jax.numpy as jnp
  import numpy as np
  from jax.experimental import multihost_utils
  from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

  import jaxflash
  from jaxflash.check import accuracy

  n = jax.device_count()
  assert jax.process_count() == 2 and jax.devices()[0].platform == platform, jax.devices()
  # the CUDA kernels take bf16/fp16 and no head dim below 64
  dtype, impl, H = (jnp.float32, None, 16) if platform == "cpu" else (jnp.bfloat16, "cuda", 64)
  mesh = jax.make_mesh((n,), ("sp",), axis_types=(AxisType.Auto,))
  # the same host arrays in both processes (same key); each feeds its own shards
  ks = jax.random.split(jax.random.key(0), 4)
  shape = lambda heads: (2, 64, heads, H)
  q, k, v, do = (np.asarray(jax.random.normal(key, shape(h)).astype(dtype))
                 for key, h in zip(ks, (4, 2, 2, 4)))
  zz = lambda x: np.asarray(jaxflash.zigzag_permute(x, n))
  sh = NamedSharding(mesh, P(None, "sp"))
  glob = lambda x: jax.make_array_from_callback(x.shape, sh, lambda idx: zz(x)[idx])
  ring = jax.shard_map(functools.partial(jaxflash.ring_attention, axis_name="sp",
                                         is_causal=True, implementation=impl), mesh=mesh,
                       in_specs=P(None, "sp"), out_specs=P(None, "sp"))
  loss = lambda q, k, v, do: jnp.sum((ring(q, k, v) * do).astype(jnp.float32))
  out = jax.jit(ring)(glob(q), glob(k), glob(v))
  grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(glob(q), glob(k), glob(v), glob(do))

  def reference(dtype):  # on the host, in `dtype`
    ref = lambda q, k, v: jaxflash.attention_reference(q, k, v, is_causal=True)[0]
    with jax.default_device(jax.local_devices(backend="cpu")[0]):
      want_out, vjp = jax.vjp(ref, *(jnp.asarray(x, dtype) for x in (q, k, v)))
      return [want_out, *vjp(jnp.asarray(do, dtype))]

  want32, want_low = reference(jnp.float32), reference(dtype)
  for name, got, w, lo in zip(("out", "dq", "dk", "dv"), (out, *grads), want32, want_low):
    got = jaxflash.zigzag_unpermute(multihost_utils.process_allgather(got, tiled=True), n)
    err, bound = accuracy(got, w, lo, dtype)
    assert err <= bound, f"process {process_id}: {name} error {err} > {bound}"
  print(f"process {process_id}: ring attention over {n} {platform} devices ok")
  jax.distributed.shutdown()


def _gpu_count():
  import jax
  try:
    return len(jax.devices("gpu"))
  except RuntimeError:
    return 0


def _worker_envs(platform):
  """Each worker's environment: 2 fake CPU devices, or its half of the GPUs."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  base = dict(os.environ)
  base["PYTHONPATH"] = os.pathsep.join(p for p in (root, base.get("PYTHONPATH")) if p)
  if platform == "cpu":
    return [dict(base, XLA_FLAGS="--xla_force_host_platform_device_count=2",
                 JAX_PLATFORMS="cpu")] * 2
  half = _gpu_count() // 2
  if half < 1:
    pytest.skip(f"needs 2 GPUs, {_gpu_count()} present")
  half = min(half, 2)  # a ring of at most 4
  # this pytest process may hold most of the GPU memory already: allocate on demand
  return [dict(base, CUDA_VISIBLE_DEVICES=",".join(str(g) for g in range(i * half, (i + 1) * half)),
               XLA_PYTHON_CLIENT_PREALLOCATE="false") for i in range(2)]


@pytest.mark.parametrize("platform", ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_ring_attention_across_two_processes(platform):
  envs = _worker_envs(platform)
  port = _free_port()
  procs = [subprocess.Popen([sys.executable, __file__, str(i), str(port), platform], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for i, env in enumerate(envs)]
  logs = []
  try:
    for p in procs:
      logs.append(p.communicate(timeout=TIMEOUT_S)[0])
  except subprocess.TimeoutExpired:
    for p in procs:
      p.kill()
    pytest.fail(f"workers did not finish in {TIMEOUT_S}s")
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  codes = [p.returncode for p in procs]
  if UNAVAILABLE in codes:
    pytest.skip("jaxlib has no CPU collectives backend (gloo): " + logs[codes.index(UNAVAILABLE)])
  assert codes == [0, 0], "\n".join(f"--- process {i} (exit {c}) ---\n{log[-3000:]}"
                                    for i, (c, log) in enumerate(zip(codes, logs)))


if __name__ == "__main__":
  _worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
