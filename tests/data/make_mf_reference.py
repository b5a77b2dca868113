"""Writes tests/data/mf_reference.json: jax_privacy 2.0.0's values for the correlated-noise tests.

Run with jax-privacy==2.0.0 installed (not needed by the tests, which read the JSON):

    python tests/data/make_mf_reference.py

Deterministic functions of fixed inputs (compared to ~1e-9), optimiser outputs (compared by loss, with a
tolerance), epsilons (dp_accounting PLD, add/remove one, grid 1e-4) and the noise structure of each mechanism
(`noise_structure`: jax_privacy's noising matrix C^{-1} for the same coefficients, as the streaming matrix its
`matrix_factorization_privatizer` runs, materialized at n = 64 in float64; checked here to be lower-triangular
Toeplitz, so its first column is stored; and its one-participation sensitivity squared, the factor of the
draws' variance: tests/test_mf_covariance.py).
"""

import json
import pathlib

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
from jax_privacy.experimental import accounting as jpa
from jax_privacy.matrix_factorization import buffered_toeplitz as bt
from jax_privacy.matrix_factorization import toeplitz

OUT = pathlib.Path(__file__).with_name("mf_reference.json")


def floats(x):
    return [float(v) for v in np.asarray(x).ravel()]


STRUCTURE_N = 64


def toeplitz_first_column(matrix):
    """The first column of a lower-triangular Toeplitz `matrix`, after checking that it is one (to 1e-12)."""
    m = np.asarray(matrix, np.float64)
    n = m.shape[0]
    col = m[:, 0]
    rows, cols = np.indices((n, n))
    expected = np.where(rows >= cols, col[np.clip(rows - cols, 0, n - 1)], 0.0)
    assert np.abs(m - expected).max() <= 1e-12 * max(1.0, np.abs(m).max()), "not lower-triangular Toeplitz"
    return floats(col)


def noise_structure():
    """jax_privacy's noising matrix C^{-1} (first column) and one-participation sensitivity^2 per mechanism."""
    n = STRUCTURE_N
    cases = [{"name": "dpsgd", "kind": "dpsgd", "inverse_first_column": floats(np.eye(n)[:, 0]),
              "sensitivity_squared": 1.0}]
    coefs = {f"bandmf_b{b}": (np.asarray(toeplitz.optimize_banded_toeplitz(n=n, bands=b)) if b > 1 else np.ones(1))
             for b in (1, 2, 4, 8)}
    coefs = {k: c / np.linalg.norm(c) for k, c in coefs.items()}
    coefs["bandmf_b3_unnormalised"] = np.array([1.0, 0.6, 0.3])  # max column norm != 1
    for name, c in coefs.items():
        cj = jnp.asarray(c)
        noising = toeplitz.inverse_as_streaming_matrix(cj).materialize(n)
        cases.append({"name": name, "kind": "bandmf", "coef": floats(c), "inverse_first_column":
                      toeplitz_first_column(noising), "sensitivity_squared": float(
                          toeplitz.minsep_sensitivity_squared(cj, min_sep=1, max_participations=1, n=n))})
    for name, decay, scale in (("blt3", [0.99, 0.9, 0.5], [0.1, 0.2, 0.2]), ("blt2", [0.95, 0.6], [0.3, 0.25])):
        blt = bt.BufferedToeplitz.build(buf_decay=decay, output_scale=scale)
        noising = blt.inverse_as_streaming_matrix().materialize(n)
        cases.append({"name": name, "kind": "blt", "buf_decay": decay, "output_scale": scale,
                      "inverse_first_column": toeplitz_first_column(noising),
                      "sensitivity_squared": float(bt.sensitivity_squared(blt, n))})
    return {"n": n, "cases": cases}


def main():
    import jax_privacy
    out = {"jax_privacy": jax_privacy.__version__, "jax": jax.__version__, "bandmf_fixed": {}, "blt_fixed": [],
           "bandmf_optimised": [], "blt_optimised": [], "epsilon": [], "noise_structure": {}}
    coef = np.array([0.7, 0.5, 0.4, 0.3])
    coef = coef / np.linalg.norm(coef)
    out["bandmf_fixed"] = {"coef": floats(coef), "n": {}}
    for n in (16, 64):
        c = jnp.asarray(coef)
        out["bandmf_fixed"]["n"][str(n)] = {
            "inverse_coef": floats(toeplitz.inverse_coef(c, n)),
            "per_query_error": floats(toeplitz.per_query_error(strategy_coef=c, n=n)),
            "minsep_sensitivity_squared": {
                f"{ms},{k}": float(toeplitz.minsep_sensitivity_squared(c, min_sep=ms, max_participations=k, n=n))
                for ms in (1, 2, 3, 4, 8) for k in (None, 1, 3)},
            "loss_mean": float(toeplitz.loss(c, n)), "loss_max": float(toeplitz.loss(c, n, jnp.max))}
    for decay, scale, n in (([0.99, 0.9, 0.5], [0.1, 0.2, 0.2], 100), ([0.95, 0.6], [0.3, 0.25], 64)):
        blt = bt.BufferedToeplitz.build(buf_decay=decay, output_scale=scale)
        inv = blt.inverse()
        coefs = blt.toeplitz_coefs(n)
        out["blt_fixed"].append({
            "buf_decay": decay, "output_scale": scale, "n": n, "toeplitz_coefs": floats(coefs),
            "inverse_toeplitz_coefs": floats(inv.toeplitz_coefs(n)),
            "sensitivity_squared": float(bt.sensitivity_squared(blt, n)),
            "max_error": float(bt.max_error(inv, n)), "max_loss": float(bt.max_loss(blt, n)),
            "per_query_error": floats(toeplitz.per_query_error(noising_coef=inv.toeplitz_coefs(n))),
            "minsep_sensitivity_squared": {
                f"{ms},{k}": float(toeplitz.minsep_sensitivity_squared(coefs, min_sep=ms, max_participations=k, n=n))
                for ms in (1, 4, 10) for k in (None, 2)}})
    for n, b in ((64, 4), (100, 2), (100, 4), (1000, 2), (1000, 8)):
        c = toeplitz.optimize_banded_toeplitz(n=n, bands=b)
        out["bandmf_optimised"].append({"n": n, "bands": b, "coef": floats(c), "loss_mean": float(toeplitz.loss(c, n))})
    for n, nbuf, min_sep, k, error in ((100, 2, 1, 1, "max"), (100, 2, 4, None, "mean")):
        blt = bt.optimize(n=n, min_sep=min_sep, max_participations=k, error=error, min_buffers=nbuf, max_buffers=nbuf)
        coefs = blt.toeplitz_coefs(n)
        sens2 = float(toeplitz.minsep_sensitivity_squared(coefs, min_sep=min_sep, max_participations=k, n=n))
        pq = np.asarray(toeplitz.per_query_error(noising_coef=blt.inverse().toeplitz_coefs(n)))
        out["blt_optimised"].append({
            "n": n, "buffers": nbuf, "min_sep": min_sep, "participations": k, "error": error,
            "buf_decay": floats(blt.buf_decay), "output_scale": floats(blt.output_scale),
            "sensitivity_squared": sens2, "loss": (float(pq.max()) if error == "max" else float(pq.mean())) * sens2})
    out["noise_structure"] = noise_structure()
    pld = lambda: dp_accounting.pld.PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE, 1e-4)
    for sigma, n, b, q in ((1.0, 100, 1, 0.01), (1.0, 1000, 1, 0.01), (1.0, 100, 4, 0.01), (1.0, 1000, 4, 0.01),
                           (1.0, 100, 4, 0.04), (1.0, 1000, 8, 0.08), (2.0, 1000, 1, 0.01)):
        event = jpa.amplified_bandmf_event(sigma, n, num_bands=b, sampling_prob=q)
        out["epsilon"].append({"event": "amplified_bandmf", "sigma": sigma, "steps": n, "bands": b, "q": q,
                               "delta": 1e-6, "epsilon": pld().compose(event).get_epsilon(1e-6)})
    out["epsilon"].append({"event": "gaussian", "sigma": 1.0, "delta": 1e-6,
                           "epsilon": pld().compose(dp_accounting.GaussianDpEvent(1.0)).get_epsilon(1e-6)})
    OUT.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    with jax.enable_x64(True):
        main()
