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
"trained on" scores high (`jaxdp.auditing.bound.gradient_scores`). Under a
correlated noise mechanism (strategy C over the audited steps, b groups) the
score is the largest over the groups g of a matched filter of the sequence
of updates U: <canary, v_g^T U> with v_g = C^T C 1_g / ||C 1_g||, 1_g the
steps of group g. It reads the canary's signal C 1_g through the whitened
updates C U (noise C x = z, white) and has the same noise for every g; it is
a function of the released updates only (not of the secret partition), which
the guarantee covers. DP-SGD (C = I, one group) keeps the total change.

The run claims epsilon = `jaxdp.accounting.epsilon(sigma, q, steps, delta)`
(PLD unless `accountant="rdp"`); clipping, clip_fn and secure_noise are the
audited run's (`jaxdp.fused_clip`'s arguments): together they are the `Claim`.
A claim with a correlated noise mechanism (`Claim.noise_mechanism`: BandMF, BLT)
runs that mechanism's noise in the step and samples like the runs it is
accounted for: every record (data and canary) gets a uniform group of
`Claim.cycle_length`, drawn once, and step t samples group t mod b at rate q;
the claim is the epsilon `jaxdp.accounting.mechanisms` gives that record
(amplified BandMF; BLT as one Gaussian release of its min-separation
sensitivity). BLT's noise is `fused_clip` with no noise followed by its
`GaussianPrivatizer` (the std of `Claim.noise_std`), as a library user runs it.
How each audit runs is its `WhiteBoxSettings` / `BlackBoxSettings`
(`jaxdp.auditing.settings`), whose `bug` plants a privacy bug the claim does
not know about, to show that the audit can fail:

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

from jaxdp._keywords import old_keywords
from jaxdp.auditing import bound as auditing
from jaxdp.auditing.settings import (  # noqa: F401
    BUGS,
    BlackBoxSettings,
    Claim,
    WhiteBoxSettings,
    field_names,
)
from jaxdp.clipping.aggregation import fused_clip
from jaxdp.core import nn
from jaxdp.core.losses import lm_losses
from jaxdp.core.per_example import per_example_grads
from jaxdp.core.terms import DenseTerm, FactoredGrad, LinearTerm, is_factored
from jaxdp.noise import strategies
from jaxdp.noise.draws import noise_key_from_seed
from jaxdp.noise.privatizer import GaussianPrivatizer
from jaxdp.noise.seeds import derive_seed, secret_seed
from jaxdp.sampling.poisson import PoissonSampler

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


def _privatizer(claim: Claim, bug: str, noise_multiplier: float, *, expected_batch_size: float, key,
                noise_std: float | None = None):
    """fused_clip as the audited run has it (`claim`'s C, clipping, clip_fn, secure_noise, noise mechanism),
    with `bug` planted. BLT: fused_clip's clipped sum, then the privatizer's noise of std `noise_std`."""
    l2_norm_clip = claim.l2_norm_clip * (_NO_CLIP_FACTOR if bug == "no_clipping" else 1)
    if claim.noise_kind == "blt":
        std = noise_std / (2 if bug == "half_noise" else 1)
        privatizer = GaussianPrivatizer(std, expected_batch_size, bool(claim.secure_noise), claim.noise_mechanism)
        return optax.chain(fused_clip(l2_norm_clip, 0.0, expected_batch_size=1.0, clip=claim.clip),
                           privatizer.transform(key))
    kw = dict(expected_batch_size=expected_batch_size, key=key, secure_noise=bool(claim.secure_noise),
              clip=claim.clip)
    if claim.noise_kind != "dpsgd":
        kw["mechanism"] = claim.noise_mechanism
    if bug == "none":
        return fused_clip(l2_norm_clip, noise_multiplier, **kw)
    if bug == "half_noise":
        return fused_clip(l2_norm_clip, noise_multiplier / 2, **kw)
    return fused_clip(l2_norm_clip, noise_multiplier / _NO_CLIP_FACTOR, **kw)


def _matched_filters(mechanism, steps: int, cycle_length: int) -> np.ndarray:
    """(groups, steps): v_g = C^T C 1_g / ||C 1_g|| for each group g with a step among `steps` (module
    docstring); a group's filter applied to the updates has the noise of one draw z_t, whatever g."""
    c_TT = strategies.strategy_matrix(mechanism, steps)
    out = []
    for g in range(min(cycle_length, steps)):
        signal_T = c_TT @ (np.arange(steps) % cycle_length == g)
        out.append(c_TT.T @ signal_T / np.linalg.norm(signal_T))
    return np.array(out)


def _check_types(settings, settings_cls, claim) -> None:
    if not isinstance(settings, settings_cls):
        raise TypeError(f"settings must be a {settings_cls.__name__}, got {type(settings).__name__}: {settings!r}")
    if not isinstance(claim, Claim):
        raise TypeError(f"claim must be a Claim, got {type(claim).__name__}: {claim!r}")


@old_keywords(settings=(WhiteBoxSettings, field_names(WhiteBoxSettings)), claim=(Claim, field_names(Claim)))
def white_box_audit(*, settings: WhiteBoxSettings = WhiteBoxSettings(), claim: Claim = Claim(),
                    seed: int | None = None) -> WhiteBoxAudit:
    """Trains once with gradient canaries and returns the one-run audit's epsilon lower bound.

    Args:
      settings: the canaries, the training, the planted bug and the bound's confidence (`WhiteBoxSettings`).
      claim: the audited DP step and its claimed epsilon (`Claim`).
      seed: pins the inclusion, data, sampling and noise; None draws a secret one.

    The keywords `settings` and `claim` replaced (`num_canaries=`, ..., `target_epsilon=`, ...) are still
    accepted for one release, with a DeprecationWarning.

    Returns:
      A `WhiteBoxAudit`: `.audit.epsilon` is the bound, `.claimed_epsilon` the accountant's epsilon.
    """
    _check_types(settings, WhiteBoxSettings, claim)
    l2_norm_clip, bug, steps = claim.l2_norm_clip, settings.bug, settings.steps
    canary_norm = 10 * l2_norm_clip if settings.canary_norm is None else settings.canary_norm
    if not canary_norm > 0:
        raise ValueError(f"canary_norm must be > 0, got {canary_norm!r}")
    mechanism = claim.mechanism()
    q, m, n = float(settings.sampling_probability), settings.num_canaries, settings.num_examples
    sigma, claimed = claim.noise_and_epsilon(q, steps)
    root = secret_seed() if seed is None else seed
    rng = np.random.default_rng(derive_seed(root, "audit_canaries"))  # the audit's own choices, not the DP step's
    included = auditing.draw_inclusion(m, rng)

    side = math.isqrt(m - 1) + 1                     # P = D = ceil(sqrt(m)): P * D >= m kernel entries
    flat = rng.choice(side * side, size=m, replace=False)
    p_M, d_M = flat // side, flat % side
    x_NP = rng.normal(size=(n, side)).astype(np.float32) / np.sqrt(side)
    y_N = np.argmax(x_NP @ rng.normal(size=(side, side)), axis=1).astype(np.int32)
    model = _SoftmaxRegression(side, side, rngs=nnx.Rngs(int(rng.integers(2**31))))
    b = claim.cycle_length  # 1: Poisson sampling of every record each step (no group drawn)
    group_N, group_M = (rng.integers(b, size=n), rng.integers(b, size=m)) if b > 1 else (0, 0)
    expected_batch_size = q * (n + m / 2) / b
    key = noise_key_from_seed(derive_seed(root, "audit_noise"))  # 256 bits, as the job's noise key
    tx = optax.chain(_privatizer(claim, bug, sigma, expected_batch_size=expected_batch_size, key=key,
                                 noise_std=claim.noise_std(sigma, q, steps)),
                     optax.sgd(settings.learning_rate))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    kernel_before = np.asarray(model.linear.kernel[...])
    filters_GT = _matched_filters(claim.noise_mechanism, steps, claim.cycle_length)
    grads_fn = per_example_grads(_losses)
    onehot_p_MP = jax.nn.one_hot(p_M, side)
    g_M1D = canary_norm * jax.nn.one_hot(d_M, side)[:, None, :]

    @nnx.jit
    def step(model, optimizer, batch, present_M):
        _, grads = grads_fn(model, batch)
        grads = _with_canaries(grads, (present_M[:, None] * onehot_p_MP)[:, None, :], g_M1D)
        optimizer.update(model, grads)

    filtered = np.zeros((len(filters_GT), *kernel_before.shape))  # sum_t v_g[t] (kernel after step t - before)
    for t in range(steps):
        batch = {"x": x_NP, "y": y_N, "mask": (rng.random(n) < q) & (group_N == t % b)}
        present_M = (included & (rng.random(m) < q) & (group_M == t % b)).astype(np.float32)
        before = np.asarray(model.linear.kernel[...], np.float64)
        step(model, optimizer, batch, present_M)
        if claim.noise_kind != "dpsgd":
            filtered += filters_GT[:, t, None, None] * (np.asarray(model.linear.kernel[...], np.float64) - before)

    if claim.noise_kind == "dpsgd":  # the total change, as the kernel's difference (the score it always had)
        change_GPD = (np.asarray(model.linear.kernel[...]) - kernel_before)[None]
    else:
        change_GPD = filtered
    # <clipped canary gradient, change>, negated: min(canary_norm, C) * -change[p_i, d_i]; the best group's.
    scores = (-min(canary_norm, l2_norm_clip) * change_GPD[:, p_M, d_M]).max(axis=0)
    audit = auditing.epsilon_lower_bound(scores, included, delta=claim.delta, ks=settings.ks,
                                         confidence=settings.confidence)
    return WhiteBoxAudit(audit=audit, claimed_epsilon=claimed, noise_multiplier=sigma, sampling_probability=q,
                         steps=steps, delta=claim.delta, bug=bug, scores=scores, included=included,
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


@old_keywords(settings=(BlackBoxSettings, field_names(BlackBoxSettings)), claim=(Claim, field_names(Claim)))
def black_box_audit(model: nnx.Module, windows: np.ndarray, vocab_size: int, *,
                    settings: BlackBoxSettings = BlackBoxSettings(), claim: Claim = Claim(),
                    seed: int | None = None, progress=None) -> BlackBoxAudit:
    """DP-Adam on `windows` plus random-token canaries, scored by their loss drop (black box).

    The canaries have the windows' length; the records (the n windows and the included
    canaries) are Poisson-sampled at q = batch_size / (n + m / 2) into batches of a fixed
    padded size (`jaxdp.sampling.poisson.PoissonSampler`, overflow truncated), and the noisy sum is
    divided by q (n + m / 2). The claim is `jaxdp.accounting.epsilon(sigma, q, steps, delta)`
    (PLD; the truncation's slack, overflow probability < 1e-9 per step, is not added). Only the final
    model is used: the audit's score is each canary's mean next-token loss under the initial
    model minus under the trained one. `settings.bug` as in `white_box_audit`.

    Args:
      model: a `jaxdp.models` language model `model(tokens_BT) -> logits_BTV`; trained in place.
      windows: (n, T + 1) int token windows (the training data).
      vocab_size: of the canaries' uniform tokens.
      settings: the canaries, the training, the planted bug and the bound's confidence (`BlackBoxSettings`).
      claim, seed: as `white_box_audit`; `progress(step)` is called after every step.

    Returns:
      A `BlackBoxAudit`.
    """
    _check_types(settings, BlackBoxSettings, claim)
    if claim.noise_kind != "dpsgd":
        raise ValueError(f"black_box_audit runs DP-SGD's noise only, got claim.noise_mechanism "
                         f"{claim.noise_mechanism!r}: audit a correlated-noise step with white_box_audit")
    num_canaries, steps, batch_size, bug = settings.num_canaries, settings.steps, settings.batch_size, settings.bug
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
    mechanism = claim.mechanism()
    q = batch_size / (n + m / 2)
    sigma, claimed = claim.noise_and_epsilon(q, steps)
    sampler = PoissonSampler(len(records), q * len(records), seed=derive_seed(root, "audit_sampler"),
                             overflow=settings.overflow)
    key = noise_key_from_seed(derive_seed(root, "audit_noise"))  # 256 bits from the root, as the job's
    tx = optax.chain(_privatizer(claim, bug, sigma, expected_batch_size=batch_size, key=key),
                     optax.adam(settings.learning_rate))
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
    audit = auditing.epsilon_lower_bound(scores, included, delta=claim.delta, ks=settings.ks,
                                         confidence=settings.confidence)
    return BlackBoxAudit(audit=audit, claimed_epsilon=claimed, noise_multiplier=sigma, sampling_probability=q,
                         steps=steps, delta=claim.delta, bug=bug, scores=scores, included=included,
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
    if config.audit.kind == "black_box" and config.dp.get("mechanism", "dpsgd") != "dpsgd":
        raise ValueError(f"config.dp.mechanism must be 'dpsgd' for the black-box audit, got "
                         f"{config.dp.mechanism!r}: audit correlated noise with config.audit.kind='white_box'")
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
