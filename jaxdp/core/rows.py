"""How a program reads the rows of one array that many parameters' updates read: a compile-shape helper
shared by the clipping (clip factors) and the noise (a group's draws)."""

import jax
import jax.numpy as jnp


def rows_apart(stacked: jax.Array) -> list[jax.Array]:
    """[stacked[j] for each j], each through an optimization barrier of its own with a traced index j: the
    same values, but each row an array that no other row's consumers read, in a kernel alike for every row.

    For the rows of one array that many parameters' updates read (a group's noise draw, the clip factors):
    read as slices of one array, XLA:GPU's sibling multi-output fusion merges all those updates into one
    kernel, which then runs out of registers and spills (the deviceless H100 figures are in WORKSPACE.md,
    "Where medium B 16's time may go"). The traced index keeps every row's
    kernel the same program, compiled once per shape (a constant index would make each row's its own)."""
    rows = []
    for j in range(stacked.shape[0]):
        whole, index = jax.lax.optimization_barrier((stacked, jnp.int32(j)))
        rows.append(jax.lax.dynamic_index_in_dim(whole, index, keepdims=False))
    return rows
