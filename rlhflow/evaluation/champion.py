"""The champion rule: when a newly registered model (the challenger) replaces the current champion.

Only a champion of the same evaluation basis (`basis.*` tags: the split files and the judge) is compared with, head
to head on the dev split (the test split never decides), after the user's guards (`evaluate.champion`). The test
is a one-sided sign test over conversations at the level alpha_k = alpha * 6 / (pi^2 k^2) for version k, so the
chance that a challenger no better than its champion is ever promoted stays at or below alpha however many
challenges come. The rule, step by step: docs/evaluation.md, The champion rule; its power: docs/mlflow.md.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np

from rlhflow.config.evaluate import ChampionConfig
from rlhflow.evaluation.stats import cluster_codes

BASIS_TAG_PREFIX = "basis."


def alpha_spent(alpha: float, challenge: int) -> float:
    """The level of challenge number `challenge` (1, 2, ...): alpha * 6 / (pi^2 k^2), summing to alpha over all k."""
    if challenge < 1:
        raise ValueError(f"challenge numbers start at 1, got {challenge}")
    return alpha * 6 / (math.pi**2 * challenge**2)


def binomial_upper_tail(successes: int, trials: int) -> float:
    """P(X >= successes) for X ~ Binomial(trials, 1/2), exactly."""
    if successes <= 0:
        return 1.0
    if successes > trials:
        return 0.0
    return sum(math.comb(trials, i) for i in range(successes, trials + 1)) / 2**trials


@dataclass(frozen=True)
class SignTest:
    wins: int  # conversations the challenger won (its mean verdict above the tie point)
    losses: int
    ties: int
    p_value: float  # one-sided: P(at least `wins` of wins + losses | no better)


def sign_test(scores: Sequence[float], clusters: Sequence[Hashable], tie: float = 0.5) -> SignTest:
    """The one-sided sign test of per-item `scores` (e.g. 1 win, 0.5 tie, 0 loss; or a difference with `tie` 0),
    aggregated per cluster (conversation) first, so several samples of one conversation count once."""
    scores = np.asarray(scores, dtype=float)
    codes = cluster_codes(clusters, len(scores))
    means = np.bincount(codes, weights=scores) / np.maximum(np.bincount(codes), 1) - tie
    wins, losses = int((means > 1e-12).sum()), int((means < -1e-12).sum())
    ties = len(means) - wins - losses
    return SignTest(wins, losses, ties, binomial_upper_tail(wins, wins + losses))


def critical_wins(trials: int, level: float) -> int | None:
    """The fewest wins out of `trials` decided conversations that the sign test promotes at `level` (None: none)."""
    tail, needed = 0, None
    for w in range(trials, -1, -1):  # P(X >= w) grows as w falls
        tail += math.comb(trials, w)
        if tail / 2**trials > level:
            break
        needed = w
    return needed


def _binomial_pmf(k: int, n: int, p: float) -> float:
    if p <= 0 or p >= 1:
        return float(k == (n if p >= 1 else 0))
    log = math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1) + k * math.log(p) + (n - k) * math.log1p(-p)
    return math.exp(log)


def promotion_power(conversations: int, win: float, tie: float, level: float) -> float:
    """The chance that the sign test promotes at `level` when each of `conversations` is, independently, a win with
    probability `win`, a tie with probability `tie` and otherwise a loss: exact, summing over the number of ties."""
    decided = 1.0 - tie
    if decided <= 0:
        return 0.0
    power = 0.0
    for n in range(1, conversations + 1):  # conversations that are not ties
        p_n = _binomial_pmf(n, conversations, decided)
        if p_n < 1e-15:
            continue
        needed = critical_wins(n, level)
        if needed is not None:
            power += p_n * sum(_binomial_pmf(w, n, win / decided) for w in range(needed, n + 1))
    return float(power)


def guard_failures(rule: ChampionConfig, *, kl: float, ended: float, length_ratio: float) -> tuple[str, ...]:
    """The guards of `rule` (evaluate.champion) the challenger fails, each named with its figure and bound."""
    failed = []
    if rule.kl_budget is not None and not kl <= rule.kl_budget:
        failed.append(f"KL to SFT {kl:.3g} nats is over the budget {rule.kl_budget:g}")
    if rule.min_ended is not None and not ended >= rule.min_ended:
        failed.append(f"ended share {ended:.3f} is under {rule.min_ended:g}")
    r = rule.max_length_ratio
    if r is not None and not 1 / r <= length_ratio <= r:
        failed.append(f"length ratio to the champion {length_ratio:.2f} is outside [{1 / r:.2f}, {r:g}]")
    return tuple(failed)


@dataclass(frozen=True)
class HeadToHead:
    """The challenger against the champion on the same dev items: `value` (its win rate over the champion, or its
    accuracy minus the champion's) with a 95% interval, for the record; the decision is the sign test's p-value
    against the level of this challenge (`alpha_spent`), after the guards."""

    metric: str
    value: float
    low: float
    high: float
    test: SignTest
    level: float  # alpha spent on this challenge
    challenge: int  # the challenger's version number
    guards_failed: tuple[str, ...] = field(default_factory=tuple)

    @property
    def challenger_wins(self) -> bool:
        return not self.guards_failed and self.test.p_value <= self.level

    def __str__(self) -> str:
        t = self.test
        text = (
            f"{self.metric} {self.value:.3f} (95% interval {self.low:.3f}-{self.high:.3f}); sign test over "
            f"conversations {t.wins} won, {t.losses} lost, {t.ties} tied: p = {t.p_value:.3g}, promotes at p <= "
            f"{self.level:.3g} (challenge {self.challenge})"
        )
        if self.guards_failed:
            text += "; guards failed: " + "; ".join(self.guards_failed)
        return text


@dataclass(frozen=True)
class ChampionDecision:
    model: str  # registered model name
    candidate: str  # version evaluated in this run
    previous: str | None  # champion version before this decision
    promoted: bool  # the alias moves to the candidate
    verdict: str  # first champion | already champion | not comparable | head to head | forced | never
    reason: str
    comparison: HeadToHead | None = None

    @property
    def champion(self) -> str | None:
        return self.candidate if self.promoted else self.previous


def basis_difference(candidate: dict[str, str], champion: dict[str, str]) -> str | None:
    """Why two evaluation bases differ (None when they are the same): each key that is missing or other."""
    if not champion:
        return "the champion records no evaluation basis"
    different = [k for k in candidate if champion.get(k) != candidate[k]]
    if not different:
        return None
    return "; ".join(f"{k} {champion.get(k, 'missing')[:8]} vs {candidate[k][:8]}" for k in different)


def decide(
    model: str,
    candidate: str,
    previous: str | None,
    *,
    not_comparable: str | None,
    comparison: HeadToHead | None,
    promote: str = "auto",
) -> ChampionDecision:
    """The decision, from what was found: `not_comparable` (the basis difference, or None) and the head-to-head
    `comparison` (measured only when comparable). `promote`: auto | force | never."""
    if promote == "never":
        return ChampionDecision(model, candidate, previous, False, "never", "evaluate.promote=never: no alias moves")
    if previous is None:
        return ChampionDecision(
            model, candidate, None, True, "first champion", f"no champion yet: v{candidate} becomes champion"
        )
    if previous == candidate:
        return ChampionDecision(
            model, candidate, previous, False, "already champion", f"v{candidate} is already the champion"
        )
    if not_comparable is not None:
        forced = promote == "force"
        reason = f"champion v{previous} not comparable ({not_comparable})"
        reason += ": promoted by evaluate.promote=force" if forced else ": kept (evaluate.promote=force promotes)"
        return ChampionDecision(model, candidate, previous, forced, "not comparable", reason)
    assert comparison is not None, "a comparable champion is measured head to head"
    wins = comparison.challenger_wins
    verdict = "beats" if wins else "does not beat"
    reason = f"v{candidate} {verdict} champion v{previous} head to head: {comparison}"
    if promote == "force" and not wins:
        return ChampionDecision(
            model, candidate, previous, True, "forced", reason + "; promoted by evaluate.promote=force", comparison
        )
    return ChampionDecision(model, candidate, previous, wins, "head to head", reason, comparison)
