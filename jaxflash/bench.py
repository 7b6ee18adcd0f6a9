"""Benchmark helpers shared by `python -m jaxflash` and benchmarks/: FLOPs, timing, peers."""

from __future__ import annotations

import ctypes
import functools
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

import jaxflash


def flops(B, N, T, S, H, is_causal, direction="fwd"):
  """The FlashAttention convention: fwd = 4*B*N*T*S*H, halved when causal; bwd = 2.5 x fwd."""
  f = 4.0 * B * N * T * S * H / (2.0 if is_causal else 1.0)
  return f * (2.5 if direction == "bwd" else 1.0)


@functools.cache
def sm_clock():
  """() -> the SM clock of the visible GPU in MHz, read through NVML (the driver's library),
  or None where there is no NVML (CPU machines). The GPU is NVML's index 0, or the first of
  CUDA_VISIBLE_DEVICES when that names one by index."""
  try:
    nvml = ctypes.CDLL("libnvidia-ml.so.1")
  except OSError:
    return None
  first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
  handle = ctypes.c_void_p()
  if nvml.nvmlInit_v2() != 0 or nvml.nvmlDeviceGetHandleByIndex_v2(
      int(first) if first.isdigit() else 0, ctypes.byref(handle)) != 0:
    return None

  def read():
    mhz = ctypes.c_uint()
    return mhz.value if nvml.nvmlDeviceGetClockInfo(handle, 1, ctypes.byref(mhz)) == 0 else None  # 1: SM
  return read


def _batch_size(fn, args):
  """Calls of fn(*args) that fill a ~20 ms batch (1 to 50), from one timed call: enough to hide
  dispatch and sync."""
  t0 = time.perf_counter()
  jax.block_until_ready(fn(*args))
  return max(1, min(50, int(0.02 / max(time.perf_counter() - t0, 1e-6))))


def medians_together(calls, warmup=3, reps=10, clocks=None, clock=None):
  """{name: median wall time of fn(*args)} of calls {name: (fn, args)}, warm: `reps` rounds,
  each timing one batch of every call in turn (the order rotated from round to round), so
  that drifts of the clocks fall on all the calls alike. A batch queues enough calls to hide
  dispatch and sync (~20 ms). With a dict `clocks`, it also gets {name: median SM clock in
  MHz at the ends of the call's batches}, read by `clock` (default sm_clock(); nothing where
  that is None): under the GPU's power cap each kernel runs at a clock of its own, so work per
  cycle is the time times the clock."""
  if not calls:
    return {}
  clock = clock or (sm_clock() if clocks is not None else None)
  mhz = {name: [] for name in calls}
  batches = {}
  for name, (fn, args) in calls.items():
    for _ in range(warmup):
      jax.block_until_ready(fn(*args))
    batches[name] = _batch_size(fn, args)
  names, times = list(calls), {name: [] for name in calls}
  for r in range(reps):
    for name in names[r % len(names):] + names[:r % len(names)]:
      fn, args = calls[name]
      t0 = time.perf_counter()
      for _ in range(batches[name]):
        out = fn(*args)
      jax.block_until_ready(out)
      times[name].append((time.perf_counter() - t0) / batches[name])
      if clock is not None and (c := clock()) is not None:
        mhz[name].append(c)
  if clocks is not None:
    clocks.update({name: statistics.median(m) for name, m in mhz.items() if m})
  return {name: statistics.median(t) for name, t in times.items()}


def sustained(calls, idle=2.0, settle=1.5, measure=3.0, clock=None):
  """{name: (seconds per call, median SM clock in MHz or None)} of calls {name: (fn, args)},
  each run alone in ~20 ms batches for `settle` + `measure` seconds after `idle` seconds of
  rest, timed over the batches after `settle`: under the power cap a kernel run on its own
  settles at a clock of its own (its energy per FLOP decides), which interleaved batches
  (medians_together) share. The calls run in order, then in reverse; a result is the mean of
  its two runs."""
  clock = clock or sm_clock() or (lambda: None)
  runs = {name: [] for name in calls}
  for order in (list(calls), list(calls)[::-1]):
    for name in order:
      fn, args = calls[name]
      batch = _batch_size(fn, args)
      time.sleep(idle)
      t0, n, mhz, start = time.perf_counter(), 0, [], None
      while True:
        t = time.perf_counter() - t0
        if start is None and t >= settle:
          start, n = t, 0
        elif start is not None and t >= settle + measure and n:
          break
        for _ in range(batch):
          out = fn(*args)
        jax.block_until_ready(out)
        n += batch
        if start is not None and (c := clock()) is not None:
          mhz.append(c)
      runs[name].append(((t - start) / n, statistics.median(mhz) if mhz else None))
  return {name: (statistics.mean(s for s, _ in r),
                 statistics.mean(c for _, c in r) if all(c for _, c in r) else None)
          for name, r in runs.items()}


def median_seconds(fn, *args, warmup=3, reps=10):
  """Median wall time of fn(*args) (medians_together of one call)."""
  return medians_together({None: (fn, args)}, warmup, reps)[None]


# Peers measured the way ANCHORS.md measures them: Mosaic GPU (JAX's Pallas Hopper attention)
# in fp16, forward only, the fastest of its key-block sizes per shape.
INPUT_DTYPE = {"mosaic": jnp.float16}
FORWARD_ONLY = {"mosaic"}
# Peers whose kernel applies no softmax scale (Mosaic's logits are q k^T): their output is
# checked on q * D^-0.5 (timings do not depend on it).
UNSCALED = {"mosaic"}
MOSAIC_BLOCK_KV = (256, 128, 64)
# Timed after the other implementations of a point, on its own: XLA's (B, N, S, S) buffers
# beside the peers' ran out of memory at 4k (a baseline, not a peer to beat).
TIMED_ALONE = {"xla"}
# A timing counts only for outputs (forward: out; backward: dq, dk, dv) within this of the
# truth (inputs are unit normals, so they are O(1); two correct bf16 kernels differ by ~1e-2):
# jaxflash's against the float32 reference on two heads, every peer's against jaxflash's.
MAX_OUTPUT_ERROR = 0.1


def _mosaic(block_kv):
  from jax.experimental.pallas.ops.gpu import attention_mgpu as mgpu
  def attn(q, k, v, c):
    config = mgpu.TuningConfig(block_q=64, block_kv=block_kv, max_concurrent_steps=2, causal=c)
    return mgpu.attention(q, k, v, config)
  return attn


def _jaxflash(q, k, v, c):
  return jaxflash.attention(q, k, v, is_causal=c)


# Rows benchmarks/bench.py adds when --peers names them: jaxflash's deterministic backward.
OPTIONS = {"jaxflash_det": lambda q, k, v, c: jaxflash.attention(
    q, k, v, is_causal=c, deterministic_backward=True)}


def peers(platform):
  """name -> attention(q, k, v, is_causal) for every implementation that loads here; a
  tuned peer maps to {config: attention}, of which a benchmark reports the fastest."""
  impls = {"jaxflash": _jaxflash}
  if platform == "gpu":
    impls["cudnn"] = lambda q, k, v, c: jax.nn.dot_product_attention(
        q, k, v, is_causal=c, implementation="cudnn")
    try:
      from flash_attn3_jax import flash_mha
      impls["fa3j"] = lambda q, k, v, c: flash_mha(q, k, v, is_causal=c)
    except ImportError:
      pass
    try:  # its import needs the Mosaic GPU runtime; any failure means the peer is absent
      from jax.experimental.pallas.ops.gpu import attention_mgpu  # noqa: F401
      impls["mosaic"] = {f"block_kv={n}": _mosaic(n) for n in MOSAIC_BLOCK_KV}
    except Exception:
      pass
  impls["xla"] = lambda q, k, v, c: jax.nn.dot_product_attention(
      q, k, v, is_causal=c, implementation="xla")
  return impls


def bench_inputs(B, T, S, N, K, H, dtype=jnp.bfloat16):
  """q, k, v, dout of a benchmark point: fresh random normals, the same for every peer."""
  keys = jax.random.split(jax.random.PRNGKey(T * 7 + H), 4)
  return (jax.random.normal(keys[0], (B, T, N, H), dtype),
          jax.random.normal(keys[1], (B, S, K, H), dtype),
          jax.random.normal(keys[2], (B, S, K, H), dtype),
          jax.random.normal(keys[3], (B, T, N, H), dtype))


def attention_outputs(attn, q, k, v, dout, is_causal, backward=True):
  """(out,) or (out, dq, dk, dv) of attn, float32."""
  if not backward:
    return (jax.jit(lambda q, k, v: attn(q, k, v, is_causal))(q, k, v).astype(jnp.float32),)
  out, vjp = jax.vjp(lambda q, k, v: attn(q, k, v, is_causal), q, k, v)
  grads = jax.jit(lambda vjp, dout: vjp(dout))(vjp, dout)
  return tuple(x.astype(jnp.float32) for x in (out, *grads))


def output_errors(attn, B, T, S, N, K, H, is_causal, dtype=jnp.bfloat16, against=None,
                  backward=True):
  """max |x - truth| of attn's out (and dq, dk, dv) on bench_inputs, and those outputs: truth
  is `against` (attention_outputs of the same inputs) or else the float32 reference on batch 0
  and the query heads of kv heads 0 and 1 (the reference is O(T S) in memory)."""
  q, k, v, dout = bench_inputs(B, T, S, N, K, H, dtype)
  got = attention_outputs(attn, q, k, v, dout, is_causal, backward)
  if against is None:
    kv = min(K, 2)
    heads = slice(0, kv * (N // K))
    f32 = lambda x: x.astype(jnp.float32)
    ref_attn = lambda q, k, v, c: jaxflash.attention_reference(q, k, v, is_causal=c)[0]
    against = attention_outputs(ref_attn, f32(q[:1, :, heads]), f32(k[:1, :, :kv]),
                                f32(v[:1, :, :kv]), f32(dout[:1, :, heads]), is_causal, backward)
    # out, dq on those query heads; dk, dv on their kv heads
    compared = [x[:1, :, :kv] if i >= 2 else x[:1, :, heads] for i, x in enumerate(got)]
  else:
    compared = got
  return [float(jnp.max(jnp.abs(x - t))) for x, t in zip(compared, against)], got


def attention_calls(attn, B, T, S, N, K, H, is_causal, dtype=jnp.bfloat16, backward=True):
  """(forward, backward or None) of attn on bench_inputs, each a (jitted fn, args) pair for
  medians_together."""
  q, k, v, dout = bench_inputs(B, T, S, N, K, H, dtype)
  fwd = jax.jit(lambda q, k, v: attn(q, k, v, is_causal))
  if not backward:
    return (fwd, (q, k, v)), None
  _, vjp = jax.vjp(lambda q, k, v: attn(q, k, v, is_causal), q, k, v)
  return (fwd, (q, k, v)), (jax.jit(lambda vjp, dout: vjp(dout)), (vjp, dout))


def prepare(builders):
  """({name: calls}, {name: error}) of builders {name: () -> attention_calls(...)}: each call
  built and run once; one that fails (a peer that cannot run a shape) leaves its error."""
  calls, failed = {}, {}
  for name, build in builders.items():
    try:
      calls[name] = build()
      for call in calls[name]:
        if call is not None:
          jax.block_until_ready(call[0](*call[1]))
    except Exception as e:
      calls.pop(name, None)
      failed[name] = _why(e)
  return calls, failed


def _why(e: Exception) -> str:
  """An exception's type and the first line of its message, for a table's notes."""
  return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:120]}"


def time_together(calls):
  """{name: (fwd seconds, bwd seconds or None)} of calls {name: attention_calls(...)}: every
  forward timed in the same rounds, then every backward."""
  fwd = medians_together({n: c[0] for n, c in calls.items()})
  bwd = medians_together({n: c[1] for n, c in calls.items() if c[1] is not None})
  return {n: (fwd[n], bwd.get(n)) for n in calls}


def measure_point(impls, B, T, S, N, K, H, is_causal, dtype=jnp.bfloat16, backward=True):
  """{name: (fwd seconds or None, bwd seconds or None, config, errors)} of impls (peers()'s
  form; "jaxflash" among them or not) at one point. Each output is checked first, one
  implementation at a time; then every right one is timed in the same rounds
  (time_together). A tuned peer reports its fastest forward's config; a peer whose output is
  wrong, or that cannot run the point, has no times, one whose gradients are wrong no
  backward time, and errors says why."""
  truth, builders = {}, {}  # truth: jaxflash's outputs, per input dtype
  errors = {name: [] for name in impls}
  for name, impl in impls.items():
    dt = INPUT_DTYPE.get(name, dtype)
    grads = backward and name not in FORWARD_ONLY
    for config, attn in (impl if isinstance(impl, dict) else {None: impl}).items():
      label = f"{config}: " if config else ""
      try:
        if name != "jaxflash" and dt not in truth:
          truth[dt] = output_errors(_jaxflash, B, T, S, N, K, H, is_causal, dt,
                                    backward=backward)[1]
        checked = attn
        if name in UNSCALED:
          checked = lambda q, k, v, c, attn=attn: attn((q * H ** -0.5).astype(q.dtype), k, v, c)
        errs, got = output_errors(checked, B, T, S, N, K, H, is_causal, dt,
                                  against=truth.get(dt), backward=grads)
      except Exception as e:  # a peer that cannot run a shape
        errors[name].append(label + _why(e))
        continue
      if name == "jaxflash":  # checked against the reference: the truth for the peers
        truth[dt] = got
      if not errs[0] <= MAX_OUTPUT_ERROR:  # NaN too
        errors[name].append(f"{label}wrong output, max error {errs[0]:.2g}")
        continue
      bwd_ok = all(e <= MAX_OUTPUT_ERROR for e in errs[1:])
      if not bwd_ok:
        errors[name].append(f"{label}wrong gradients, max error (dq, dk, dv) " +
                            ", ".join(f"{e:.2g}" for e in errs[1:]))
      builders[name, config] = functools.partial(attention_calls, attn, B, T, S, N, K, H,
                                                 is_causal, dt, backward=grads and bwd_ok)
  del truth
  times = {}
  for group in ([key for key in builders if key[0] not in TIMED_ALONE],
                [key for key in builders if key[0] in TIMED_ALONE]):
    calls, failed = prepare({key: builders[key] for key in group})
    times.update(time_together(calls))
    del calls  # before the next group's buffers
    for (name, config), e in failed.items():
      errors[name].append(f"{f'{config}: ' if config else ''}{e}")
  out = {name: (None, None, None, errors[name]) for name in impls}
  for (name, config), (t_fwd, t_bwd) in times.items():
    if out[name][0] is None or t_fwd < out[name][0]:
      out[name] = (t_fwd, t_bwd, config, errors[name])
  return out


def progress(items, label=""):
  """A dependency-free progress bar on stderr."""
  items = list(items)
  width = 30
  for i, item in enumerate(items):
    done = int(width * i / max(len(items), 1))
    sys.stderr.write(f"\r{label} [{'#' * done}{'.' * (width - done)}] {i}/{len(items)}")
    sys.stderr.flush()
    yield item
  sys.stderr.write(f"\r{label} [{'#' * width}] {len(items)}/{len(items)}\n")
  sys.stderr.flush()
