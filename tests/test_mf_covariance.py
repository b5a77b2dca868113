"""The exact covariance of the noise the DP step releases, for each mechanism, in float64.

The draws Z of the step are replaced by variables (`jaxdp.noise.draws.gaussians` patched to return std times
them), and the linear map M from unit draws to the released noise (times the expected batch size) is
differentiated out of `fused_clip`'s update (DP-SGD, BandMF) or the `GaussianPrivatizer`'s (BLT, which
`fused_clip` does not take), run for n = 64 steps on two leaves in JAX's x64 mode. Then

    M M^T = sigma^2 C'^2 (Cn^{-1} Cn^{-T}) (x) I,     Cn = C / (C's max column norm),   C' = C_clip x 1.000122,

with C built densely here from the coefficients (not by `jaxdp.noise`), to a float64 tolerance; and equal to
jax_privacy 2.0.0's noise structure s^2 N N^T for the same coefficients (N its noising matrix, s its
one-participation sensitivity: frozen in tests/data/mf_reference.json, live where jax_privacy is installed).
x64 is switched on by a fixture's context manager only, so it does not reach other tests.
"""

import importlib.util
import json
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdp
from jaxdp.accounting import mechanisms as mf
from jaxdp.noise import draws, strategies
from jaxdp.noise.mechanisms import BLT, DPSGD, BandMF
from jaxdp.noise.privatizer import GaussianPrivatizer

REFERENCE = json.loads((pathlib.Path(__file__).parent / "data" / "mf_reference.json").read_text())
STRUCTURE = REFERENCE["noise_structure"]
CASES = {c["name"]: c for c in STRUCTURE["cases"]}
N = STRUCTURE["n"]                    # 64 steps
SIGMA, CLIP, EBS = 1.7, 0.8, 3.0
CLIP_SENSITIVITY = CLIP * math.sqrt(1 + 2.0**-12)  # C': the clip bound times its rounding factor
LEAVES = {"b": (2,), "w": (1, 3)}     # P = 5 values per step


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield
    assert not jax.config.jax_enable_x64


def mechanism_of(case):
    if case["kind"] == "dpsgd":
        return DPSGD()
    if case["kind"] == "bandmf":
        return BandMF(tuple(case["coef"]))
    return BLT(tuple(case["buf_decay"]), tuple(case["output_scale"]))


def dense_strategy(case, n):
    """C (n x n, float64) from the case's coefficients alone: c_k down the k-th subdiagonal."""
    c = np.zeros(n)
    if case["kind"] == "dpsgd":
        c[0] = 1.0
    elif case["kind"] == "bandmf":
        c[:len(case["coef"])] = case["coef"]
    else:
        c[0] = 1.0
        for w, theta in zip(case["output_scale"], case["buf_decay"]):
            c[1:] += w * theta ** np.arange(n - 1)
    rows, cols = np.indices((n, n))
    return np.where(rows >= cols, c[np.clip(rows - cols, 0, n - 1)], 0.0)


def expected_covariance(strategy, p):
    """sigma^2 C'^2 (Cn^{-1} Cn^{-T}) (x) I_p, Cn = C / its max column norm, the (step, value) order."""
    cn = strategy / np.linalg.norm(strategy, axis=0).max()
    inv = np.linalg.solve(cn, np.eye(len(cn)))
    return (SIGMA * CLIP_SENSITIVITY) ** 2 * np.kron(inv @ inv.T, np.eye(p))


def jax_privacy_covariance(inverse_first_column, sensitivity_squared, p):
    """jax_privacy's noise of the same coefficients: draws of std sigma C' s, correlated by N (Toeplitz)."""
    col = np.asarray(inverse_first_column)
    rows, cols = np.indices((len(col), len(col)))
    noising = np.where(rows >= cols, col[np.clip(rows - cols, 0, len(col) - 1)], 0.0)
    return (SIGMA * CLIP_SENSITIVITY) ** 2 * sensitivity_squared * np.kron(noising @ noising.T, np.eye(p))


def make_update(mechanism):
    """(the step's update of noise sums, params): fused_clip's for DP-SGD / BandMF, else the privatizer's with
    the std `jaxdp.accounting.mechanisms.noise_std` prescribes for one participation."""
    params = {k: jnp.zeros(s, jnp.float64) for k, s in LEAVES.items()}
    if isinstance(mechanism, BLT):
        sens = strategies.sensitivity(mechanism, N, 1, 1)
        tx = GaussianPrivatizer(mf.noise_std("blt", SIGMA, CLIP_SENSITIVITY, sens), EBS,
                                mechanism=mechanism).transform(jax.random.key(0))
        sums = params
    else:
        tx = jaxdp.fused_clip(CLIP, SIGMA, expected_batch_size=EBS, key=jax.random.key(0), mechanism=mechanism)
        sums = {k: jnp.zeros((2, *s), jnp.float64) for k, s in LEAVES.items()}  # zero per-example gradients
    return tx, sums, params


def released_noise_map(mechanism, monkeypatch):
    """M (N P x N P): d(released noise x EBS at step t, value i) / d(unit draw at step s, value j)."""
    tx, sums, params = make_update(mechanism)
    current, stds = {}, []

    def variable_draws(leaf_keys, leaves, std, shards=None, secure=False):
        assert not secure and shards is None
        stds.append(std)
        sizes = np.cumsum([math.prod(leaf.shape) for leaf in leaves])[:-1]
        return [std * z.reshape(leaf.shape) for z, leaf in zip(jnp.split(current["z"], sizes), leaves)]

    monkeypatch.setattr(draws, "gaussians", variable_draws)

    @jax.jit
    def step(z, state):
        current["z"] = z
        updates, state = tx.update(sums, state, params)
        return jnp.concatenate([u.ravel() for u in jax.tree.leaves(updates)]) * EBS, state

    def run(z_NP):
        state, out = tx.init(params), []
        for z in z_NP:
            x, state = step(z, state)
            out.append(x)
        return jnp.stack(out)

    p = sum(math.prod(s) for s in LEAVES.values())
    jacobian = jax.jacfwd(run)(jnp.zeros((N, p), jnp.float64))
    assert jacobian.dtype == jnp.float64 and len(set(stds)) == 1
    return np.asarray(jacobian).reshape(N * p, N * p), p


def assert_covariance_close(got, want):
    """float64: each entry sums <= N products of entries that are each a recursion over <= N steps."""
    scale = np.abs(want).max()
    np.testing.assert_allclose(got, want, rtol=0, atol=N * N * np.finfo(np.float64).eps * scale)


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_steps_noise_has_the_strategys_exact_covariance(name, x64, monkeypatch):
    case = CASES[name]
    m, p = released_noise_map(mechanism_of(case), monkeypatch)
    covariance = m @ m.T
    assert_covariance_close(covariance, expected_covariance(dense_strategy(case, N), p))
    assert_covariance_close(covariance, jax_privacy_covariance(case["inverse_first_column"],
                                                               case["sensitivity_squared"], p))


def test_a_planted_error_in_the_structure_is_caught(x64, monkeypatch):
    """Three planted errors the comparison must see: one coefficient of the reference off by 1e-9 relative, the
    std without the column norm (the unnormalised strategy) and the stream in float32 (the draws, buffers
    and arithmetic of a non-x64 run) instead of float64."""
    case = CASES["bandmf_b4"]
    m, p = released_noise_map(mechanism_of(case), monkeypatch)
    wrong = dict(case, coef=[case["coef"][0] * (1 + 1e-9)] + case["coef"][1:])
    with pytest.raises(AssertionError):
        assert_covariance_close(m @ m.T, expected_covariance(dense_strategy(wrong, N), p))

    unnormalised = CASES["bandmf_b3_unnormalised"]
    m3, _ = released_noise_map(mechanism_of(unnormalised), monkeypatch)
    strategy = dense_strategy(unnormalised, N)
    inv = np.linalg.inv(strategy)  # C^{-1} C^{-T} without the column norm: the draws' std would miss ||c||
    with pytest.raises(AssertionError):
        assert_covariance_close(m3 @ m3.T, (SIGMA * CLIP_SENSITIVITY) ** 2 * np.kron(inv @ inv.T, np.eye(p)))

    mechanism = mechanism_of(case)
    eye = jnp.eye(N, dtype=jnp.float32)

    def stream(buffers, z):
        x, buffers = mechanism.next(z, buffers)
        return buffers, x

    m32 = np.asarray(jax.lax.scan(stream, mechanism.init_buffers(eye[0]), eye)[1], np.float64)  # (t, s)
    cn = dense_strategy(case, N) / math.sqrt(sum(c * c for c in case["coef"]))
    inv = np.linalg.inv(cn)
    assert m32.dtype == np.float64 and np.abs(m32 - inv).max() < 1e-5  # float32 is close ...
    with pytest.raises(AssertionError):  # ... but not float64-exact
        assert_covariance_close(m32 @ m32.T, inv @ inv.T)


@pytest.mark.skipif(importlib.util.find_spec("jax_privacy") is None, reason="jax_privacy is not installed")
@pytest.mark.parametrize("name", sorted(CASES))
def test_live_jax_privacy_noise_structure(name, x64):
    """jax_privacy's own noising matrices, materialised in full, equal the frozen first columns (Toeplitz) and
    the dense reference built here."""
    from jax_privacy.matrix_factorization import buffered_toeplitz, toeplitz
    case = CASES[name]
    if case["kind"] == "dpsgd":
        return
    if case["kind"] == "bandmf":
        coef = jnp.asarray(case["coef"])
        noising = np.asarray(toeplitz.inverse_as_streaming_matrix(coef).materialize(N))
        sens2 = float(toeplitz.minsep_sensitivity_squared(coef, min_sep=1, max_participations=1, n=N))
    else:
        blt = buffered_toeplitz.BufferedToeplitz.build(buf_decay=case["buf_decay"], output_scale=case["output_scale"])
        noising = np.asarray(blt.inverse_as_streaming_matrix().materialize(N))
        sens2 = float(buffered_toeplitz.sensitivity_squared(blt, N))
    assert sens2 == pytest.approx(case["sensitivity_squared"], rel=1e-12)
    live = (SIGMA * CLIP_SENSITIVITY) ** 2 * sens2 * noising @ noising.T
    assert_covariance_close(np.kron(live, np.eye(1)), jax_privacy_covariance(
        case["inverse_first_column"], case["sensitivity_squared"], 1))
    assert_covariance_close(live, expected_covariance(dense_strategy(case, N), 1))
