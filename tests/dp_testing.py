"""Shared fixtures for DP tests: tiny models, batches, loss functions, comparisons."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxdp
import jaxdp.core.losses
import jaxdp.core.reference  # the vmap oracle: not exported by jaxdp
from jaxdp.models.gpt2 import GPT2, GPT2Config


def lm_loss(model, batch):
    """Per-example mean next-token NLL, zero for masked (padding) examples."""
    nll = jaxdp.core.losses.token_nll(model, batch["tokens"][:, :-1], batch["tokens"][:, 1:])  # frozen head: chunks
    return jnp.where(batch["mask"], nll.mean(axis=-1), 0.0)


def tiny_gpt2(seed=0, *, remat=False, vocab_size=97, seq_len=32, dtype="float32"):
    config = GPT2Config.preset("tiny", vocab_size=vocab_size, seq_len=seq_len, remat=remat, dtype=dtype)
    return GPT2(config, rngs=nnx.Rngs(seed))


def lm_batch(seed, B=6, T=16, vocab_size=97, num_masked=1):
    tokens = jax.random.randint(jax.random.key(seed), (B, T + 1), 0, vocab_size)
    mask = jnp.arange(B) < B - num_masked
    return {"tokens": tokens, "mask": mask}


def by_path(tree):
    """{path tuple: array} of an nnx.State (Variables or plain leaves) or of a path dict."""
    if isinstance(tree, dict) and all(isinstance(k, tuple) for k in tree):
        return tree
    return {tuple(p): (v.get_value() if isinstance(v, nnx.Variable) else v)
            for p, v in nnx.to_flat_state(tree)}


def max_rel_err(actual, expected):
    """max over parameters of max|a - e| / max|e| (normwise relative error).

    In NumPy on the host, in the arrays' dtype (as jnp would compute it): on the device every new
    shape, dtype and sharding would compile its own small subtract / abs / max programs."""
    actual, expected = by_path(actual), by_path(expected)
    assert actual.keys() == expected.keys(), set(actual) ^ set(expected)
    errs = []
    for p in expected:
        a, e = np.asarray(actual[p]), np.asarray(expected[p])
        errs.append(float(np.max(np.abs(a - e)) / np.max(np.abs(e))))
    return max(errs)


@functools.partial(nnx.jit, static_argnums=0)
def reference_grads(loss_fn, model, batch):
    """(losses (B,), {path: per-example gradients (B, ...)}) of the vmap reference, jitted: one compile
    per loss, model structure and batch shape, shared by every test (and test file) that asks for it."""
    return jaxdp.core.reference.per_example_grads(loss_fn, model, batch)


def clip_between(ref_grads):
    """A C strictly between the smallest and largest non-zero per-example norm of `{path: (B, ...)}`
    per-example gradients (on the host: no second compile of the reference for its norms)."""
    sq = sum(np.sum(np.square(np.asarray(g, np.float64).reshape(g.shape[0], -1)), axis=1)
             for g in ref_grads.values())
    n = np.sort(np.sqrt(sq[sq > 0]))
    assert n[0] < n[-1], n
    return float(np.sqrt(n[0] * n[-1]))


def first_updates_fn(loss_fn, txs, **grads_kwargs):
    """A jitted (model, batch) -> [first update of each tx]: every configuration in one compile."""
    grads_fn = jaxdp.per_example_grads(loss_fn, **grads_kwargs)

    @nnx.jit
    def all_updates(model, batch):
        _, grads = grads_fn(model, batch)
        params = nnx.state(model, nnx.Param)
        return [tx.update(grads, tx.init(params), params)[0] for tx in txs]

    return all_updates


def assert_json_close(actual, expected, *, rtol, atol=0.0, where="$"):
    """Two JSON values (dicts, lists, numbers, strings, bools, None) equal, floats within rtol / atol.

    Keys, lengths, types, strings, bools and None compare exactly; only floats compare with a tolerance.
    (pytest.approx compares flat numeric containers only: from pytest 9 it raises on a None or a string.)
    """
    if isinstance(expected, dict):
        assert isinstance(actual, dict) and actual.keys() == expected.keys(), (where, actual, expected)
        for k in expected:
            assert_json_close(actual[k], expected[k], rtol=rtol, atol=atol, where=f"{where}.{k}")
    elif isinstance(expected, (list, tuple)):
        assert isinstance(actual, (list, tuple)) and len(actual) == len(expected), (where, actual, expected)
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_json_close(a, e, rtol=rtol, atol=atol, where=f"{where}[{i}]")
    elif isinstance(expected, float) and isinstance(actual, (int, float)) and not isinstance(actual, bool):
        assert np.isclose(actual, expected, rtol=rtol, atol=atol, equal_nan=True), (where, actual, expected)
    else:
        assert type(actual) is type(expected) and actual == expected, (where, actual, expected)
