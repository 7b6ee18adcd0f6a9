"""Ring attention across 2 processes on loopback: jax.distributed with CPU collectives (gloo).

The test starts this file twice as a worker (2 CPU devices each, so a ring of 4 devices over
2 processes); each worker checks its part of the result against the reference.
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


def _worker(process_id, port):
  import functools

  import jax
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

  assert jax.process_count() == 2 and jax.device_count() == 4, jax.devices()
  mesh = jax.make_mesh((4,), ("sp",), axis_types=(AxisType.Auto,))
  # the same host arrays in both processes (same key); each feeds its own shards
  ks = jax.random.split(jax.random.key(0), 4)
  shape = lambda heads: (2, 64, heads, 16)
  q, k, v, do = (np.asarray(jax.random.normal(key, shape(h))) for key, h in zip(ks, (4, 2, 2, 4)))
  zz = lambda x: np.asarray(jaxflash.zigzag_permute(x, 4))
  sh = NamedSharding(mesh, P(None, "sp"))
  glob = lambda x: jax.make_array_from_callback(x.shape, sh, lambda idx: zz(x)[idx])
  ring = jax.shard_map(functools.partial(jaxflash.ring_attention, axis_name="sp",
                                         is_causal=True), mesh=mesh, in_specs=P(None, "sp"),
                       out_specs=P(None, "sp"))
  loss = lambda q, k, v, do: jnp.sum(ring(q, k, v) * do)
  out = jax.jit(ring)(glob(q), glob(k), glob(v))
  grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(glob(q), glob(k), glob(v), glob(do))

  ref = lambda q, k, v: jaxflash.attention_reference(q, k, v, is_causal=True)[0]
  want_out, vjp = jax.vjp(ref, q, k, v)
  want = [want_out, *vjp(jnp.asarray(do))]
  for name, got, w in zip(("out", "dq", "dk", "dv"), (out, *grads), want):
    got = jaxflash.zigzag_unpermute(multihost_utils.process_allgather(got, tiled=True), 4)
    err = float(np.max(np.abs(np.asarray(got) - np.asarray(w))))
    assert err < 2e-5, f"process {process_id}: {name} error {err}"
  print(f"process {process_id}: ring attention over {jax.device_count()} devices ok")
  jax.distributed.shutdown()


def test_ring_attention_across_two_processes():
  port = _free_port()
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
             JAX_PLATFORMS="cpu")
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
  procs = [subprocess.Popen([sys.executable, __file__, str(i), str(port)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for i in range(2)]
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
  _worker(int(sys.argv[1]), int(sys.argv[2]))
