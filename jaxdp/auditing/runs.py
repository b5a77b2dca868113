"""Training runs for the one-run audit (`jaxdp.auditing.bound`): white box (gradient canaries) and black box.

`white_box_audit` is the CI-sized audit of the DP step itself (arXiv:2305.08846,
white-box setting, many canaries per step): a tiny softmax
regression built from `jaxdp.core.nn.Linear`, trained with DP-SGD through the real
pipeline (`jaxdp.per_example_grads` -> `jaxdp.fused_clip` -> `optax.sgd`), on
synthetic data plus m GRADIENT canaries. Canary i is a record whose per-example
gradient is the fixed matrix `canary_norm * e_{p_i} e_{d_i}^T` on the kernel (a
"Dirac" canary: one coordinate of its own), passed to `fused_clip` in factored
form next to the data's per-example gradients. Each canary is in the dataset
with probability 1/2, and, like every data record, Poisson-sampled into each
step with probability q. The score of a canary is the inner product of its
CLIPPED gradient with the total parameter change, sign-flipped so that
"trained on" scores high (`jaxdp.auditing.bound.gradient_scores`).

The run claims epsilon = `jaxdp.accounting.epsilon(sigma, q, steps, delta)`
(PLD unless `accountant="rdp"`); clipping, clip_fn and secure_noise are the
audited run's (`jaxdp.fused_clip`'s arguments). `bug` plants a privacy bug
the claim does not know about, to show that the audit can fail:

  "none"         the correct step.
  "half_noise"   noise standard deviation sigma C / 2 (sigma halved).
  "no_clipping"  per-example gradients are not clipped (the clip threshold is
                 set far above every norm), noise still sigma C.

The divisor of the noisy sum is q (n + m / 2), the EXPECTED dataset size, not
one that depends on which canaries were drawn in (that would leak the count).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxdp.accounting import accountant as accounting
from jaxdp.accounting import calibration
from jaxdp.auditing import bound as auditing
from jaxdp.clipping.aggregation import fused_clip
from jaxdp.clipping.settings import ClipSpec
from jaxdp.core import nn
from jaxdp.core.losses import lm_losses
from jaxdp.core.per_example import per_example_grads
from jaxdp.core.terms import DenseTerm, FactoredGrad, LinearTerm, is_factored
from jaxdp.noise.draws import noise_key_from_seed
from jaxdp.noise.seeds import derive_seed, secret_seed
from jaxdp.sampling.poisson import PoissonSampler

BUGS = ("none", "half_noise", "no_clipping")
_NO_CLIP_FACTOR = 1e6  # "no_clipping": C' = 1e6 C, noise multiplier sigma / 1e6 (same noise std)


@dataclasses.dataclass(frozen=True)
class WhiteBoxAudit:
    """What `white_box_audit` ran, claimed and found."""
    audit: auditing.AuditResult   # .epsilon: the lower bound
    claimed_epsilon: float        # what the accountant says the run spent (inf for sigma = 0)
    noise_multiplier: float
    sampling_probability: float
    steps: int
    delta: float
    bug: str
    scores: np.ndarray            # (m,)
    included: np.ndarray          # (m,) bool
    mechanism: dict               # clipping, clip_fn, secure_noise, accountant, l2_norm_clip (`_mechanism`)
    seed_pinned: bool             # a seed was given: its noise is as secret as that seed


class _SoftmaxRegression(nnx.Module):
    def __init__(self, features: int, classes: int, *, rngs: nnx.Rngs):
        self.linear = nn.Linear(features, classes, rngs=rngs)

    def __call__(self, x_BP):
        return self.linear(x_BP)


def _losses(model, batch):
    nll_B = optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"])
    return jnp.where(batch["mask"], nll_B, 0.0)


def _with_canaries(grads, x_M1P, g_M1D):
    """The data's per-example gradients followed by the canaries': the model's one LinearTerm (its
    kernel) gets the canaries' factors, every other term zeros for them."""
    m = x_M1P.shape[0]

    def extend(fg: FactoredGrad) -> FactoredGrad:
        terms = []
        for t in fg.terms:
            if isinstance(t, LinearTerm):
                terms.append(LinearTerm(jnp.concatenate([t.x_BTP, x_M1P.astype(t.x_BTP.dtype)]),
                                        jnp.concatenate([t.g_BTD, g_M1D.astype(t.g_BTD.dtype)])))
            elif isinstance(t, DenseTerm):
                terms.append(DenseTerm(jnp.concatenate([t.value_B, jnp.zeros((m,) + t.shape, t.value_B.dtype)])))
            else:
                raise TypeError(f"unexpected term {type(t).__name__}")
        return FactoredGrad(tuple(terms))

    return jax.tree.map(extend, grads, is_leaf=is_factored)


def _privatizer(bug: str, l2_norm_clip: float, noise_multiplier: float, expected_batch_size: float, key,
                mechanism: dict):
    """fused_clip as the audited run has it (`mechanism`: clipping, clip_fn, secure_noise), with `bug` planted."""
    kw = dict(expected_batch_size=expected_batch_size, key=key, secure_noise=mechanism["secure_noise"],
              clip=ClipSpec(mechanism["clipping"], mechanism["clip_fn"]))
    if bug == "none":
        return fused_clip(l2_norm_clip, noise_multiplier, **kw)
    if bug == "half_noise":
        return fused_clip(l2_norm_clip, noise_multiplier / 2, **kw)
    return fused_clip(l2_norm_clip * _NO_CLIP_FACTOR, noise_multiplier / _NO_CLIP_FACTOR, **kw)


def _mechanism(clipping: str, clip_fn: str, secure_noise: bool, accountant: str, l2_norm_clip: float) -> dict:
    """What the audit ran, as `jaxdp.training.receipt.record_audit` compares it with a run's receipt."""
    if accountant not in accounting.ACCOUNTANTS:
        raise ValueError(f"accountant must be one of {accounting.ACCOUNTANTS}, got {accountant!r}")
    return {"clipping": clipping, "clip_fn": clip_fn, "secure_noise": bool(secure_noise),
            "accountant": accountant, "l2_norm_clip": float(l2_norm_clip)}


def _claim(target_epsilon, noise_multiplier, q, steps, delta, accountant) -> tuple[float, float]:
    """(sigma, the claimed epsilon): sigma calibrated to `target_epsilon` unless given."""
    sigma = (calibration.calibrate_noise_multiplier(target_epsilon, q, steps, delta, accountant=accountant)
             if noise_multiplier is None else float(noise_multiplier))
    return sigma, accounting.epsilon(sigma, q, steps, delta, accountant=accountant)


def white_box_audit(*, num_canaries: int = 2000, num_examples: int = 32, steps: int = 4,
                    sampling_probability: float = 1.0, target_epsilon: float = 2.0,
                    noise_multiplier: float | None = None, delta: float = 1e-5, l2_norm_clip: float = 1.0,
                    canary_norm: float | None = None, learning_rate: float = 1.0, bug: str = "none",
                    ks=None, confidence: float = auditing.DEFAULT_CONFIDENCE, clipping: str = "flat",
                    clip_fn: str = "abadi", secure_noise: bool = False, accountant: str = "pld",
                    seed: int | None = None) -> WhiteBoxAudit:
    """Trains once with gradient canaries and returns the one-run audit's epsilon lower bound.

    Args:
      num_canaries: m, canaries (each included with probability 1/2); the kernel has >= m entries.
      num_examples: synthetic data records (Gaussian features, labels of a random teacher).
      steps: DP-SGD steps.
      sampling_probability: q, Poisson rate of every record (data and included canaries) per step.
      target_epsilon: the epsilon the run claims, sigma calibrated to it (PLD) when
        `noise_multiplier` is None.
      noise_multiplier: sigma; 0 is no noise (the claim is then infinite).
      delta: of the claim and of the audit.
      l2_norm_clip: C.
      canary_norm: norm of each canary's gradient; None: 10 C (> C, so that skipped clipping shows).
      learning_rate: of optax.sgd.
      bug: one of `BUGS`: a planted privacy bug the claim ignores.
      ks: (k_plus, k_minus) guesses tried (union bound); None: `jaxdp.auditing.bound.default_guesses(m)`.
      confidence: of the lower bound.
      clipping, clip_fn, secure_noise: `jaxdp.fused_clip`'s, as the audited run has them.
      accountant: of the claim ("pld" | "rdp").
      seed: pins the inclusion, data, sampling and noise; None draws a secret one.

    Returns:
      A `WhiteBoxAudit`: `.audit.epsilon` is the bound, `.claimed_epsilon` the accountant's epsilon.
    """
    if bug not in BUGS:
        raise ValueError(f"bug must be one of {BUGS}, got {bug!r}")
    for name, value in (("num_canaries", num_canaries), ("num_examples", num_examples), ("steps", steps)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if not 0 < sampling_probability <= 1:
        raise ValueError(f"sampling_probability must be in (0, 1], got {sampling_probability!r}")
    canary_norm = 10 * l2_norm_clip if canary_norm is None else canary_norm
    if not canary_norm > 0:
        raise ValueError(f"canary_norm must be > 0, got {canary_norm!r}")
    mechanism = _mechanism(clipping, clip_fn, secure_noise, accountant, l2_norm_clip)
    q, m, n = float(sampling_probability), num_canaries, num_examples
    sigma, claimed = _claim(target_epsilon, noise_multiplier, q, steps, delta, accountant)
    root = secret_seed() if seed is None else seed
    rng = np.random.default_rng(derive_seed(root, "audit_canaries"))  # the audit's own choices, not the DP step's
    included = auditing.draw_inclusion(m, rng)

    side = math.isqrt(m - 1) + 1                     # P = D = ceil(sqrt(m)): P * D >= m kernel entries
    flat = rng.choice(side * side, size=m, replace=False)
    p_M, d_M = flat // side, flat % side
    x_NP = rng.normal(size=(n, side)).astype(np.float32) / np.sqrt(side)
    y_N = np.argmax(x_NP @ rng.normal(size=(side, side)), axis=1).astype(np.int32)
    model = _SoftmaxRegression(side, side, rngs=nnx.Rngs(int(rng.integers(2**31))))
    expected_batch_size = q * (n + m / 2)
    key = noise_key_from_seed(derive_seed(root, "audit_noise"))  # 256 bits, as the job's noise key
    tx = optax.chain(_privatizer(bug, l2_norm_clip, sigma, expected_batch_size, key, mechanism),
                     optax.sgd(learning_rate))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    kernel_before = np.asarray(model.linear.kernel[...])
    grads_fn = per_example_grads(_losses)
    onehot_p_MP = jax.nn.one_hot(p_M, side)
    g_M1D = canary_norm * jax.nn.one_hot(d_M, side)[:, None, :]

    @nnx.jit
    def step(model, optimizer, batch, present_M):
        _, grads = grads_fn(model, batch)
        grads = _with_canaries(grads, (present_M[:, None] * onehot_p_MP)[:, None, :], g_M1D)
        optimizer.update(model, grads)

    for _ in range(steps):
        batch = {"x": x_NP, "y": y_N, "mask": rng.random(n) < q}
        present_M = (included & (rng.random(m) < q)).astype(np.float32)
        step(model, optimizer, batch, present_M)

    change = np.asarray(model.linear.kernel[...]) - kernel_before
    # <clipped canary gradient, total change>, negated: min(canary_norm, C) * -change[p_i, d_i].
    scores = -min(canary_norm, l2_norm_clip) * change[p_M, d_M]
    audit = auditing.epsilon_lower_bound(scores, included, delta=delta, ks=ks, confidence=confidence)
    return WhiteBoxAudit(audit=audit, claimed_epsilon=claimed, noise_multiplier=sigma, sampling_probability=q,
                         steps=steps, delta=delta, bug=bug, scores=scores, included=included,
                         mechanism=mechanism, seed_pinned=seed is not None)


# ------------------------------------------------------------------ black box: random-token canaries


@dataclasses.dataclass(frozen=True)
class BlackBoxAudit:
    """What `black_box_audit` ran, claimed and found."""
    audit: auditing.AuditResult
    claimed_epsilon: float
    noise_multiplier: float
    sampling_probability: float
    steps: int
    delta: float
    bug: str
    scores: np.ndarray            # (m,) loss before training minus after
    included: np.ndarray          # (m,) bool
    canaries: np.ndarray          # (m, T + 1) int32 token sequences
    loss_before: np.ndarray       # (m,) the canaries' mean next-token loss under the initial model
    loss_after: np.ndarray
    mechanism: dict
    seed_pinned: bool


def random_token_canaries(num_canaries: int, length: int, vocab_size: int, rng: np.random.Generator) -> np.ndarray:
    """(m, length) int32 sequences of independent uniform tokens: no two alike, none like real text."""
    if num_canaries < 1 or length < 2 or vocab_size < 2:
        raise ValueError(f"need num_canaries >= 1, length >= 2, vocab_size >= 2; got {num_canaries!r}, "
                         f"{length!r}, {vocab_size!r}")
    return rng.integers(0, vocab_size, size=(num_canaries, length), dtype=np.int32)


_jit_lm_losses = nnx.jit(lm_losses)


def _canary_losses(model, canaries, batch_size: int) -> np.ndarray:
    loss = _jit_lm_losses
    out = []
    for lo in range(0, len(canaries), batch_size):
        tokens = canaries[lo:lo + batch_size]
        pad = batch_size - len(tokens)
        tokens = np.concatenate([tokens, np.zeros((pad, tokens.shape[1]), tokens.dtype)])
        out.append(np.asarray(loss(model, {"tokens": tokens, "mask": np.arange(batch_size) < batch_size - pad})))
    return np.concatenate(out)[:len(canaries)]


def black_box_audit(model: nnx.Module, windows: np.ndarray, vocab_size: int, *, num_canaries: int = 256,
                    steps: int = 100, batch_size: float = 32, target_epsilon: float = 2.0,
                    noise_multiplier: float | None = None, delta: float = 1e-5, l2_norm_clip: float = 1.0,
                    learning_rate: float = 3e-3, bug: str = "none", ks=None,
                    confidence: float = auditing.DEFAULT_CONFIDENCE, clipping: str = "flat",
                    clip_fn: str = "abadi", secure_noise: bool = False, accountant: str = "pld",
                    overflow: str = "truncate", seed: int | None = None, progress=None) -> BlackBoxAudit:
    """DP-Adam on `windows` plus random-token canaries, scored by their loss drop (black box).

    The canaries have the windows' length; the records (the n windows and the included
    canaries) are Poisson-sampled at q = batch_size / (n + m / 2) into batches of a fixed
    padded size (`jaxdp.sampling.poisson.PoissonSampler`, overflow truncated), and the noisy sum is
    divided by q (n + m / 2). The claim is `jaxdp.accounting.epsilon(sigma, q, steps, delta)`
    (PLD; the truncation's slack, overflow probability < 1e-9 per step, is not added). Only the final
    model is used: the audit's score is each canary's mean next-token loss under the initial
    model minus under the trained one. `bug` as in `white_box_audit`.

    Args:
      model: a `jaxdp.models` language model `model(tokens_BT) -> logits_BTV`; trained in place.
      windows: (n, T + 1) int token windows (the training data).
      vocab_size: of the canaries' uniform tokens.
      overflow: the sampler's (`jaxdp.sampling.poisson.OVERFLOW_MODES`).
      Other arguments as `white_box_audit`; `progress(step)` is called after every step.

    Returns:
      A `BlackBoxAudit`.
    """
    if bug not in BUGS:
        raise ValueError(f"bug must be one of {BUGS}, got {bug!r}")
    windows = np.asarray(windows)
    if windows.ndim != 2 or windows.shape[1] < 2:
        raise ValueError(f"windows must be (n, T + 1) tokens with T >= 1, got shape {windows.shape}")
    n, m = windows.shape[0], num_canaries
    if not 0 < batch_size <= n + m / 2:
        raise ValueError(f"batch_size must be in (0, n + m / 2] = (0, {n + m / 2}], got {batch_size!r}")
    root = secret_seed() if seed is None else seed
    rng = np.random.default_rng(derive_seed(root, "audit_canaries"))  # the audit's own choices, not the DP step's
    canaries = random_token_canaries(m, windows.shape[1], vocab_size, rng)
    included = auditing.draw_inclusion(m, rng)
    records = np.concatenate([windows, canaries[included]]).astype(np.int32)
    mechanism = _mechanism(clipping, clip_fn, secure_noise, accountant, l2_norm_clip)
    q = batch_size / (n + m / 2)
    sigma, claimed = _claim(target_epsilon, noise_multiplier, q, steps, delta, accountant)
    sampler = PoissonSampler(len(records), q * len(records), seed=derive_seed(root, "audit_sampler"),
                             overflow=overflow)
    key = noise_key_from_seed(derive_seed(root, "audit_noise"))  # 256 bits from the root, as the job's
    tx = optax.chain(_privatizer(bug, l2_norm_clip, sigma, batch_size, key, mechanism), optax.adam(learning_rate))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    loss_before = _canary_losses(model, canaries, sampler.max_batch_size)
    grads_fn = per_example_grads(lm_losses)

    @nnx.jit
    def step(model, optimizer, batch):
        _, grads = grads_fn(model, batch)
        optimizer.update(model, grads)

    for s in range(steps):
        indices, mask = sampler.sample(s)
        step(model, optimizer, {"tokens": records[indices], "mask": mask})
        if progress is not None:
            progress(s + 1)
    loss_after = _canary_losses(model, canaries, sampler.max_batch_size)
    scores = auditing.loss_drop_scores(loss_before, loss_after)
    audit = auditing.epsilon_lower_bound(scores, included, delta=delta, ks=ks, confidence=confidence)
    return BlackBoxAudit(audit=audit, claimed_epsilon=claimed, noise_multiplier=sigma, sampling_probability=q,
                         steps=steps, delta=delta, bug=bug, scores=scores, included=included,
                         canaries=canaries, loss_before=loss_before, loss_after=loss_after,
                         mechanism=mechanism, seed_pinned=seed is not None)


AUDIT_KINDS = ("black_box", "white_box")


def check_audit_config(config) -> None:
    """ValueError, naming the field, unless the audit job (`experiments/audit.py`) can run `config`."""
    from jaxdp.training import hosts
    if hosts.launched_as_one_of_several():
        raise ValueError("the audit runs in one process: unset JAX_COORDINATOR_ADDRESS")
    if config.audit.kind not in AUDIT_KINDS:
        raise ValueError(f"config.audit.kind must be one of {AUDIT_KINDS}, got {config.audit.kind!r}")
    if config.dp.delta is None:
        raise ValueError("config.dp.delta must be set: the audited claim's delta")
    if config.privacy.unit != "window":
        raise ValueError(f"config.privacy.unit must be 'window' (the audit inserts canary windows), "
                         f"got {config.privacy.unit!r}")
    if not config.dp.enabled or config.dp.method != "bookkeeping":
        raise ValueError(f"config.dp.enabled must be True and config.dp.method 'bookkeeping' (the audit runs the "
                         f"one-backward DP step), got {config.dp.enabled!r} / {config.dp.method!r}")


def report(result, kind: str, data_desc: str, seconds: float) -> str:
    """The audit job's printed result: claim, lower bound, what the audit could show at best, the verdict."""
    a = result.audit
    verdict = ("EXCEEDS the claim: evidence of a privacy bug" if a.epsilon > result.claimed_epsilon else
               f"CANNOT DETECT anything: the largest bound this audit can reach ({a.max_epsilon:.4g}) is <= the "
               "claim; use more canaries or a smaller config.dp.target_epsilon"
               if a.max_epsilon <= result.claimed_epsilon else
               "within the claim (a lower bound: this does not prove the claim)")
    return "\n".join([
        f"one-run audit ({kind}, bug={result.bug}; {data_desc})",
        f"  claimed epsilon  {result.claimed_epsilon:.4g}  (sigma {result.noise_multiplier:.4g}, "
        f"q {result.sampling_probability:.4g}, {result.steps} steps, delta {result.delta:g})",
        f"  lower bound      {a.epsilon:.4g}  at {a.confidence:.0%} ({a.num_correct}/{a.num_guesses} guesses "
        f"correct, k+={a.k_plus} k-={a.k_minus}, {a.num_hypotheses} guesses tried)",
        f"  max attainable   {a.max_epsilon:.4g}  (every guess right)",
        f"  canaries         {a.num_canaries} ({a.num_included} included)",
        f"  verdict          {verdict}",
        f"  time             {seconds:.1f} s",
    ])
