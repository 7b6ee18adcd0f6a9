"""One forward and one backward of the CUDA kernels, for ncu and compute-sanitizer (the forward
only at head dims the CUDA backward lacks).

  ncu --kernel-name regex:'flash_fwd_kernel|main_kernel' --launch-skip 2 --launch-count 2 \
      --set full -o prof python benchmarks/profile_kernels.py --D 128 --S 4096
  compute-sanitizer --tool racecheck python benchmarks/profile_kernels.py --small
  compute-sanitizer --tool racecheck python benchmarks/profile_kernels.py --segments
  compute-sanitizer --tool racecheck python benchmarks/profile_kernels.py --rules
  compute-sanitizer --tool racecheck python benchmarks/profile_kernels.py --many-tiles
  compute-sanitizer --tool memcheck python benchmarks/profile_kernels.py --many-tiles --deterministic
  compute-sanitizer --tool memcheck python benchmarks/profile_kernels.py --variants
"""

import argparse

import jax
import jax.numpy as jnp

import jaxflash
from jaxflash import _calls

p = argparse.ArgumentParser()
p.add_argument("--D", type=int, default=128)
p.add_argument("--Dv", type=int, default=None, help="value head dim (default: D)")
p.add_argument("--S", type=int, default=4096)
p.add_argument("--causal", action="store_true")
p.add_argument("--small", action="store_true", help="a tiny ragged GQA problem (sanitizers)")
p.add_argument("--segments", action="store_true",
               help="a ragged GQA problem over several key tiles with segment ids of 3 packed "
                    "documents, one query document absent from the keys (sanitizers)")
p.add_argument("--rules", action="store_true",
               help="the segments problem's shape with a window and ragged lengths instead of "
                    "ids: the key-range rules kernels (sanitizers)")
p.add_argument("--many-tiles", action="store_true",
               help="a ragged GQA problem of 1400 rows in more query tiles than an H100 has SMs "
                    "(144 of 192 rows at H = 64, 198 of 128 otherwise), so that CTAs of the "
                    "persistent forward (plain, and causal up to 4k rows) run two (sanitizers)")
p.add_argument("--sections", type=int, nargs="?", const=2500, default=None,
               help="a causal GQA problem of this many rows (2500: past the backward's first-store "
                    "tickets, 6 (b, kv head) pairs; up to 2048: within them, 10 pairs) whose pairs "
                    "fill two sections of the backward's grid, the last narrower (sanitizers)")
p.add_argument("--variants", action="store_true",
               help="the segments problem's shape (S = 704: whole 16-byte bias rows) through "
                    "the variant kernels, five calls: a (B, N, T, S) bias with bottom-right "
                    "causal and ragged lengths, a bias over the keys, soft cap with ALiBi and a "
                    "window (these three forwards on the sm90 rules kernel on Hopper, at D = 128 "
                    "the first one's backward too), a mask with dropout (the sm80-class "
                    "kernels), soft cap with a window (the sm90 rules kernels, forward and "
                    "backward) (sanitizers)")
p.add_argument("--kv", type=int, default=300,
               help="keys of the --many-tiles problem")
p.add_argument("--jump", action="store_true",
               help="keys below 64 scaled 40x and below 320 3x, so that row maxima jump as the "
                    "key tiles are visited: the D=128 forward's lazy max rescales and recomputes "
                    "S (sanitizers, with --many-tiles --kv 700)")
p.add_argument("--deterministic", action="store_true", help="deterministic_backward=True")
p.add_argument("--reps", type=int, default=2)
a = p.parse_args()
B, T, S, N, K, D = ((1, 77, 45, 4, 2, a.D) if a.small
                    else (2, 300, 700, 4, 2, a.D) if a.segments or a.rules
                    else (2, 300, 704, 4, 2, a.D) if a.variants
                    else (2, 1400, a.kv, 9, 3, a.D) if a.many_tiles
                    else (3 if a.sections > 2048 else 5, a.sections, a.sections, 4, 2, a.D)
                    if a.sections
                    else (16384 // a.S, a.S, a.S, 2048 // a.D, 2048 // a.D, a.D))
ids = {}
if a.segments:
  docs = lambda n: jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32) * 3 // n, (B, n))
  ids = dict(query_segment_ids=docs(T), key_value_segment_ids=jnp.where(docs(S) == 1, 7, docs(S)))
if a.rules:
  ids = dict(local_window_size=(200, 40), query_seq_lengths=jnp.array([300, 170], jnp.int32),
             key_value_seq_lengths=jnp.array([650, 700], jnp.int32))
keys = jax.random.split(jax.random.PRNGKey(0), 4)
q = jax.random.normal(keys[0], (B, T, N, D), jnp.bfloat16)
k = jax.random.normal(keys[1], (B, S, K, D), jnp.bfloat16)
if a.jump:
  key = jnp.arange(S)[None, :, None, None]
  k = (k * jnp.where(key < 64, 40.0, jnp.where(key < 320, 3.0, 1.0))).astype(jnp.bfloat16)
Dv = a.Dv or D
v = jax.random.normal(keys[2], (B, S, K, Dv), jnp.bfloat16)
dout = jax.random.normal(keys[3], (B, T, N, Dv), jnp.bfloat16)
has_bwd = _calls.cuda_bwd_head_dims_error(D, Dv) is None
calls = [dict(is_causal=a.causal, **ids)]
if a.variants:
  vkeys = jax.random.split(jax.random.PRNGKey(1), 4)
  lens = dict(query_seq_lengths=jnp.array([300, 170], jnp.int32),
              key_value_seq_lengths=jnp.array([650, 700], jnp.int32))
  calls = [dict(bias=jax.random.normal(vkeys[0], (B, N, T, S), jnp.bfloat16), is_causal=True,
                causal_alignment="bottom_right", **lens),
           dict(bias=jax.random.normal(vkeys[1], (B, 1, 1, S), jnp.bfloat16), **lens),
           dict(logits_soft_cap=20.0, alibi_slopes=jnp.full((N,), 0.1),
                local_window_size=(200, 40), **lens),
           dict(mask=jax.random.uniform(vkeys[2], (B, 1, T, S)) < 0.7, dropout_rate=0.2,
                dropout_rng=vkeys[3], **lens),
           dict(logits_soft_cap=20.0, local_window_size=(200, 40), **lens)]
for kw in calls:
  attn = lambda q, k, v, kw=kw: jaxflash.attention(q, k, v, implementation="cuda",
                                                   deterministic_backward=a.deterministic, **kw)
  fwd = jax.jit(attn)
  bwd = jax.jit(lambda q, k, v, dout, attn=attn: jax.vjp(attn, q, k, v)[1](dout))
  for _ in range(a.reps):
    jax.block_until_ready(fwd(q, k, v))
    if has_bwd:
      jax.block_until_ready(bwd(q, k, v, dout))
print("done", B, T, S, N, K, D, Dv, "forward and backward" if has_bwd else "forward")
