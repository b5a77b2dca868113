"""Pallas GPU kernels (Triton backend) for per-example norms and clip-and-aggregate of linear layers.

Each module holds a kernel, its `pallas_call` wrapper, the public op and
`<op>_reference` in plain jnp (float32): the test oracle, and what XLA alone
does (bench_kernels times it as the baseline). On a CPU backend the kernels run in the Pallas interpreter
(`interpret=None` resolves to True there).

  linear_sq_norms            ||x_b^T g_b||^2, tiles reduced over T on chip   (linear_norms.py)
  linear_ghost_sq_norms      <x_b x_b^T, g_b g_b^T>, Gram tiles on chip      (ghost_norms.py)
  linear_clipped_sum         sum_b c_b x_b^T g_b, scale fused into the load  (clipped_sum.py)
  linear_fused_clipped_sum   per-layer single pass: G_b tiles once, scratch  (single_pass.py)
  chacha_words.block_words   ChaCha20 keystream for secure noise, rounds in registers (chacha_words.py)
"""

from jaxdp.pallas.clipped_sum import linear_clipped_sum, linear_clipped_sum_reference
from jaxdp.pallas.ghost_norms import linear_ghost_sq_norms, linear_ghost_sq_norms_reference
from jaxdp.pallas.linear_norms import linear_sq_norms, linear_sq_norms_reference
from jaxdp.pallas.single_pass import linear_fused_clipped_sum, linear_fused_clipped_sum_reference

__all__ = [
    "linear_clipped_sum",
    "linear_clipped_sum_reference",
    "linear_fused_clipped_sum",
    "linear_fused_clipped_sum_reference",
    "linear_ghost_sq_norms",
    "linear_ghost_sq_norms_reference",
    "linear_sq_norms",
    "linear_sq_norms_reference",
]
