"""Moving the `champion` alias of a registered model: the evaluation basis recorded on each version (`basis.*`
tags), the rule of rlhflow/evaluation/champion.py applied against the current champion, and the decision's basis kept as
`champion.*` tags on the candidate version."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rlhflow.evaluation.champion import BASIS_TAG_PREFIX, ChampionDecision, HeadToHead, basis_difference, decide
from rlhfops.registry import CHAMPION, version_by_alias


def evaluation_basis(client, name: str, version: str) -> dict[str, str]:
    """The `basis.*` tags of a registered version: what it was trained and evaluated on."""
    tags = client.get_model_version(name, version).tags
    return {k.removeprefix(BASIS_TAG_PREFIX): v for k, v in tags.items() if k.startswith(BASIS_TAG_PREFIX)}


def challenge_champion(
    client,
    name: str,
    candidate: str,
    basis: dict[str, str],
    head_to_head: Callable[[Any, int], HeadToHead | None],
    promote: str = "auto",
) -> ChampionDecision:
    """Decide whether `candidate` (evaluated on `basis`) replaces the current champion.
    `head_to_head(version, challenge)` measures the candidate against the champion on the same items (None: there is
    nothing to compare on); it is called only for a champion of the same basis, with `challenge`, the candidate's
    version number (the alpha spent on it: champion.alpha_spent). Records `basis` on the candidate; the alias is not
    moved yet (`apply_champion_decision`)."""
    for key, value in basis.items():
        client.set_model_version_tag(name, candidate, BASIS_TAG_PREFIX + key, value)
    current = version_by_alias(client, name, CHAMPION)
    previous = None if current is None else str(current.version)
    difference = comparison = None
    if previous not in (None, candidate) and promote != "never":
        difference = basis_difference(basis, evaluation_basis(client, name, previous))
        if difference is None:
            comparison = head_to_head(current, int(candidate))
            if comparison is None:
                difference = "no dev split to compare on (validate.dev_fraction is 0)"
    return decide(name, candidate, previous, not_comparable=difference, comparison=comparison, promote=promote)


def apply_champion_decision(client, decision: ChampionDecision, run_id: str | None = None) -> None:
    """Record the decision basis as tags on the candidate version and move `champion` when it won."""
    c = decision.comparison
    tags = {
        "compared_with": f"v{decision.previous}" if decision.previous else "none",
        "verdict": decision.verdict,
        "decision": "promoted" if decision.promoted else "kept",
        "reason": decision.reason,
        **(
            {
                "metric": c.metric,
                "value": f"{c.value:.6g}",
                "ci_low": f"{c.low:.6g}",
                "ci_high": f"{c.high:.6g}",
                "p_value": f"{c.test.p_value:.6g}",
                "level": f"{c.level:.6g}",
                "challenge": str(c.challenge),
                "wins_losses_ties": f"{c.test.wins}/{c.test.losses}/{c.test.ties}",
                "guards_failed": "; ".join(c.guards_failed) or "none",
            }
            if c
            else {}
        ),
        **({"evaluation_run": run_id} if run_id else {}),
    }
    for key, value in tags.items():
        client.set_model_version_tag(decision.model, decision.candidate, f"champion.{key}", value)
    if decision.promoted:
        client.set_registered_model_alias(decision.model, CHAMPION, decision.candidate)
