"""A run's privacy budget: `BudgetTracker` counts steps and refuses the one that would exceed it.

The privacy spent by `steps` steps is `jaxdp.accounting.epsilon` (host-side,
no jax) of the Poisson-subsampled Gaussian composed over the run's rounds:
one per step for DP-SGD, one per `cycle_length` steps for amplified BandMF
(`jaxdp.accounting.mechanisms`, whose `MechanismAccounting` `BudgetTracker.of`
reads); the tracker adds the step count, the stop before the target epsilon
and a JSON-serialisable state for checkpoints. The training loop
(`jaxdp.training.loop`) keeps one per run. A "blt" run is one Gaussian
release of the whole run: `ReleaseTracker` counts the epsilon of its prefix
(`MechanismAccounting.prefix_sensitivity`) instead.

Example::

    sigma = calibration.calibrate_noise_multiplier(8.0, sampling_probability=0.01,
                                                  steps=10_000, delta=1e-5)
    tracker = BudgetTracker(sigma, 0.01, 1e-5, target_epsilon=8.0)
    while tracker.can_step():
        ...                                    # one DP-SGD step
        tracker.step()
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jaxdp.accounting import accountant as accounting
from jaxdp.accounting import calibration, mechanisms


class BudgetTracker:
    """Counts steps and refuses the step that would exceed the budget.

    The tracker holds no RNG or accountant state: the privacy spent is a
    function of (noise_multiplier, sampling_probability, delta, steps,
    cycle_length), so `state_dict()` is a small JSON-serialisable dict and a
    restored tracker reports exactly the same epsilon.

    With a `target_epsilon`, the step budget `max_steps` =
    `steps_for_epsilon(target_epsilon, ...)` is computed once, on the first
    `can_step` / `step` (epsilon is nondecreasing in steps, so "steps + n <=
    max_steps" is "epsilon(steps + n) <= target"); after that both are O(1),
    so calling them every training step costs nothing even with PLD.

    Args:
      noise_multiplier: sigma used at every step, >= 0.
      sampling_probability: q, in (0, 1].
      delta: target delta, in (0, 1).
      target_epsilon: budget, > 0, or None for no limit (tracking only).
      accountant: "pld" (default) or "rdp", as in `accounting.epsilon`.
      value_discretization_interval: PLD only, as in `accounting.epsilon`.
      cycle_length: steps per composition, >= 1: 1 for DP-SGD; the bands b for amplified BandMF, whose
        s steps are ceil(s / b) rounds at the group's sampling probability
        (`jaxdp.accounting.mechanisms.MechanismAccounting.rounds`; build it with `BudgetTracker.of`).

    Example::

      >>> tracker = BudgetTracker(1.1, 0.01, 1e-5, target_epsilon=2.0, accountant="rdp")
      >>> tracker.step(1000)
      >>> round(tracker.epsilon(), 3), tracker.can_step(600)
      (1.712, False)
      >>> restored = BudgetTracker.from_state_dict(tracker.state_dict())
      >>> restored.steps, restored.epsilon() == tracker.epsilon()
      (1000, True)
    """

    # Cap for the step budget; far beyond any real run.
    _BUDGET_SEARCH_LIMIT = 2**40

    def __init__(
        self,
        noise_multiplier: float,
        sampling_probability: float,
        delta: float,
        *,
        target_epsilon: float | None = None,
        accountant: str = "pld",
        value_discretization_interval: float = accounting.DEFAULT_VALUE_DISCRETIZATION_INTERVAL,
        cycle_length: int = 1,
    ):
        self.noise_multiplier = accounting._check_noise_multiplier(noise_multiplier)
        self.sampling_probability = accounting._check_sampling_probability(sampling_probability)
        self.delta = accounting._check_delta(delta)
        self.target_epsilon = (None if target_epsilon is None
                               else accounting._check_target_epsilon(target_epsilon))
        accounting._check_accountant(accountant, value_discretization_interval)
        self.accountant = accountant
        self.value_discretization_interval = float(value_discretization_interval)
        self.cycle_length = accounting._check_count("cycle_length", cycle_length)
        if self.cycle_length < 1:
            raise ValueError(f"cycle_length must be an integer >= 1, got {cycle_length!r}")
        self._steps = 0
        self._epsilon_cache: tuple[int, float] | None = None  # (steps, epsilon)
        self._max_steps: int | None = None

    @classmethod
    def of(cls, run: mechanisms.MechanismAccounting, noise_multiplier: float, delta: float, *,
           target_epsilon: float | None = None, accountant: str = "pld",
           value_discretization_interval: float = accounting.DEFAULT_VALUE_DISCRETIZATION_INTERVAL,
           prefix: Callable[[int], mechanisms.MechanismAccounting] | None = None) -> BudgetTracker:
        """The tracker of a run accounted as `run`: its epsilon after s steps is
        `mechanisms.epsilon_for(run with steps=s, noise_multiplier, delta)` ("dpsgd", "bandmf"), or for
        "blt" `mechanisms.epsilon_for(prefix(s), ...)`, a `ReleaseTracker` (`prefix` required: s steps ->
        the accounting of the run's first s steps, with their prefix sensitivity)."""
        if run.kind == "blt":
            if prefix is None:
                raise ValueError("a 'blt' run is one release of the whole run: BudgetTracker.of needs prefix, "
                                 "steps -> the MechanismAccounting of its first steps (prefix_sensitivity)")
            return ReleaseTracker(noise_multiplier, delta, prefix, run.steps, target_epsilon=target_epsilon,
                                  accountant=accountant, value_discretization_interval=value_discretization_interval)
        return cls(noise_multiplier, run.sampling_probability, delta, target_epsilon=target_epsilon,
                   accountant=accountant, value_discretization_interval=value_discretization_interval,
                   cycle_length=run.cycle_length)

    @property
    def steps(self) -> int:
        """Steps taken so far."""
        return self._steps

    @property
    def max_steps(self) -> int | None:
        """Total steps the budget allows (None without a target_epsilon)."""
        if self.target_epsilon is None:
            return None
        if self._max_steps is None:  # R rounds allow the steps s with ceil(s / cycle_length) <= R
            self._max_steps = self.cycle_length * calibration.steps_for_epsilon(
                self.target_epsilon, self.noise_multiplier, self.sampling_probability,
                self.delta, accountant=self.accountant,
                max_steps=self._BUDGET_SEARCH_LIMIT // self.cycle_length,
                value_discretization_interval=self.value_discretization_interval)
        return self._max_steps

    def epsilon(self) -> float:
        """Epsilon spent by the steps taken so far (cached per step count)."""
        if self._epsilon_cache is None or self._epsilon_cache[0] != self._steps:
            self._epsilon_cache = (self._steps, self._epsilon_at(self._steps))
        return self._epsilon_cache[1]

    def can_step(self, n: int = 1) -> bool:
        """Whether `n` more steps keep epsilon <= target_epsilon."""
        n = accounting._check_count("n", n)
        return self.target_epsilon is None or self._steps + n <= self.max_steps

    def step(self, n: int = 1) -> None:
        """Records `n` steps; raises RuntimeError if they would exceed the budget."""
        if not self.can_step(n):
            raise RuntimeError(
                f"privacy budget exhausted: {n} more step(s) after {self._steps} would "
                f"spend epsilon = {self._epsilon_at(self._steps + n):.4g} > "
                f"target_epsilon = {self.target_epsilon:g} at delta = {self.delta:g} "
                f"({self.accountant} accountant; the budget allows {self.max_steps} "
                "steps in total). Stop training here.")
        self._steps += n

    def state_dict(self) -> dict[str, Any]:
        """The constructor arguments and the step count, JSON-serialisable (`cycle_length` only when it is
        not 1: a DP-SGD run's checkpoint is as before)."""
        return {
            "noise_multiplier": self.noise_multiplier,
            "sampling_probability": self.sampling_probability,
            "delta": self.delta,
            "target_epsilon": self.target_epsilon,
            "accountant": self.accountant,
            "value_discretization_interval": self.value_discretization_interval,
            "steps": self._steps,
            **({} if self.cycle_length == 1 else {"cycle_length": self.cycle_length}),
        }

    def restored(self, state: dict[str, Any]) -> BudgetTracker:
        """A tracker like this one at the step count of `state` (another tracker's `state_dict()`, e.g. a
        checkpoint's): `from_state_dict(state)`; a `ReleaseTracker` keeps its prefix function."""
        return type(self).from_state_dict(state)

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> BudgetTracker:
        """Rebuilds a tracker from `state_dict()` output (a "blt" state: `ReleaseTracker.restored`)."""
        if state.get("kind") == "blt":
            raise ValueError("a 'blt' tracker's state needs its prefix function: use ReleaseTracker.restored(state)")
        tracker = cls(
            state["noise_multiplier"], state["sampling_probability"], state["delta"],
            target_epsilon=state["target_epsilon"], accountant=state["accountant"],
            value_discretization_interval=state.get(
                "value_discretization_interval", accounting.DEFAULT_VALUE_DISCRETIZATION_INTERVAL),
            cycle_length=state.get("cycle_length", 1))
        tracker._steps = accounting._check_count("steps", state["steps"])
        return tracker

    def _epsilon_at(self, steps: int) -> float:
        rounds = -(-steps // self.cycle_length)
        return accounting._epsilon(self.noise_multiplier, self.sampling_probability, rounds,
                                   self.delta, self.accountant, self.value_discretization_interval)

    def __repr__(self) -> str:
        return (f"BudgetTracker(noise_multiplier={self.noise_multiplier}, "
                f"sampling_probability={self.sampling_probability}, delta={self.delta}, "
                f"target_epsilon={self.target_epsilon}, accountant={self.accountant!r}, "
                f"steps={self._steps}" + ("" if self.cycle_length == 1 else f", cycle_length={self.cycle_length}")
                + ")")


class ReleaseTracker(BudgetTracker):
    """The budget of a run accounted as one Gaussian release ("blt", no amplification): epsilon after s of
    its `total_steps` steps is `mechanisms.epsilon_for(prefix(s), noise_multiplier, delta)`, the release
    of the first s steps (sensitivity `prefix(s).prefix_sensitivity` under the run's noise std), which is
    nondecreasing in s and the whole run's epsilon at s = total_steps. `max_steps` is the largest s <=
    total_steps within the target (bisection); no step beyond total_steps is allowed, as the strategy and
    its sensitivity are the run's. Its state is `BudgetTracker`'s plus "kind": "blt" and "total_steps";
    restore it with `restored(state)` (the prefix function is not state).
    """

    def __init__(self, noise_multiplier: float, delta: float,
                 prefix: Callable[[int], mechanisms.MechanismAccounting], total_steps: int, *,
                 target_epsilon: float | None = None, accountant: str = "pld",
                 value_discretization_interval: float = accounting.DEFAULT_VALUE_DISCRETIZATION_INTERVAL):
        super().__init__(noise_multiplier, 1.0, delta, target_epsilon=target_epsilon, accountant=accountant,
                         value_discretization_interval=value_discretization_interval)
        self.total_steps = accounting._check_count("total_steps", total_steps)
        self._prefix = prefix

    @property
    def max_steps(self) -> int:
        if self._max_steps is None:
            if self.target_epsilon is None:
                self._max_steps = self.total_steps
            else:
                lo, hi = 0, self.total_steps  # epsilon(lo) <= target (0 steps cost 0); find the largest such
                while lo < hi:
                    mid = (lo + hi + 1) // 2
                    lo, hi = (mid, hi) if self._epsilon_at(mid) <= self.target_epsilon else (lo, mid - 1)
                self._max_steps = lo
        return self._max_steps

    def can_step(self, n: int = 1) -> bool:
        n = accounting._check_count("n", n)
        return self._steps + n <= self.max_steps

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "kind": "blt", "total_steps": self.total_steps}

    def restored(self, state: dict[str, Any]) -> ReleaseTracker:
        if state.get("kind") != "blt":
            raise ValueError(f"not a 'blt' tracker's state: {state!r}")
        tracker = ReleaseTracker(state["noise_multiplier"], state["delta"], self._prefix, state["total_steps"],
                                 target_epsilon=state["target_epsilon"], accountant=state["accountant"],
                                 value_discretization_interval=state["value_discretization_interval"])
        tracker._steps = accounting._check_count("steps", state["steps"])
        return tracker

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> BudgetTracker:
        raise ValueError("a ReleaseTracker's state needs its prefix function: use tracker.restored(state)")

    def _epsilon_at(self, steps: int) -> float:
        return mechanisms.epsilon_for(self._prefix(steps), self.noise_multiplier, self.delta,
                                      accountant=self.accountant,
                                      value_discretization_interval=self.value_discretization_interval)

    def __repr__(self) -> str:
        return (f"ReleaseTracker(noise_multiplier={self.noise_multiplier}, delta={self.delta}, "
                f"total_steps={self.total_steps}, target_epsilon={self.target_epsilon}, "
                f"accountant={self.accountant!r}, steps={self._steps})")
