"""Dimension legend for the shape comments used throughout jaxgdn and pallas_kernels.

  B    batch rows (sequences)                 T    tokens in one call
  N    KV-cache capacity (tokens)             D    hidden size
  HK   GDN key/query heads                    HV   GDN value heads (a multiple of HK)
  K    GDN key head dim                       V    GDN value head dim
  C    GDN conv channels = 2*HK*K + HV*V      KC   conv kernel width (4): the conv state keeps KC-1 inputs
  H    attention query heads                  HKV  attention key/value heads
  Dh   attention head dim                     R    rotary dims = Dh * partial_rotary_factor
  I    MLP intermediate size                  E    experts;  Ek  experts per token (top-k)
  Vocab vocabulary size
"""

import jax

Array = jax.Array


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1): the row buckets of `generate`'s prefill, `score` and the
    engine, and the part counts of the cache's restore."""
    return 1 << max(int(n) - 1, 0).bit_length()
