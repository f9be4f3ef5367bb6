"""The reward-KL frontier: where a policy lands against best-of-n sampling from the SFT model (docs/evaluation.md).

Best-of-n keeps the highest of n SFT samples by the reward PPO optimises (the proxy score minus
`missing_eos_penalty` for an answer that never ended); its KL to the SFT model is log n - (n - 1) / n (Stiennon et
al. 2020), a free baseline curve: an RL policy should reach a higher judge reward at the same KL. Per prompt N
answers are sampled once, and the expected best-of-n score for every n <= N is exact over all n-subsets (the i-th
lowest objective is the best of a random n-subset with probability C(i-1, n-1) / C(N, n)), for the objective and
for the judge score of the objective's pick.
"""

from __future__ import annotations

# matplotlib is imported by the plot alone: heavy, and only a sweep draws the frontier.
import math
from dataclasses import dataclass

import numpy as np

from rlhflow.evaluation import stats


def objective_name(missing_eos_penalty: float | None) -> str:
    """What best-of-n selects by and the frontier plots as the optimised reward."""
    if missing_eos_penalty is None:
        return "proxy"
    return f"proxy - missing_eos_penalty * not_ended (missing_eos_penalty={missing_eos_penalty:g})"


def objective_scores(proxy: np.ndarray, ended: np.ndarray | None, missing_eos_penalty: float | None) -> np.ndarray:
    """PPO's sequence reward before the KL term: proxy - missing_eos_penalty * (1 - ended) (None: the proxy)."""
    proxy = np.asarray(proxy, dtype=float)
    if missing_eos_penalty is None:
        return proxy
    if ended is None:
        raise ValueError("a missing_eos_penalty needs each sample's ended flag")
    return proxy - missing_eos_penalty * (1 - np.asarray(ended, dtype=float))


def best_of_n_kl(n: int) -> float:
    """KL(best-of-n || SFT) in nats: log n - (n - 1) / n."""
    return math.log(n) - (n - 1) / n


def best_of_n_weights(n: int, samples: int) -> np.ndarray:
    """Probability that the i-th lowest of `samples` values (i = 1..samples) is the highest of a random n-subset."""
    if not 1 <= n <= samples:
        raise ValueError(f"best-of-n needs 1 <= n <= samples, got n={n}, samples={samples}")
    return np.array([math.comb(i - 1, n - 1) for i in range(1, samples + 1)], dtype=float) / math.comb(samples, n)


def best_of_n_scores(proxy: np.ndarray, judge: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Per prompt, the expected score of best-of-n by `proxy` (the objective it selects by) and the expected `judge`
    value of the response it picks. `proxy`, `judge`: [prompts, samples] values of the same responses."""
    order = np.argsort(proxy, axis=1, kind="stable")  # ascending by the objective: the pick is the last
    weights = best_of_n_weights(n, proxy.shape[1])
    return (
        (np.take_along_axis(proxy, order, axis=1) * weights).sum(axis=1),
        (np.take_along_axis(judge, order, axis=1) * weights).sum(axis=1),
    )


@dataclass(frozen=True)
class FrontierPoint:
    """One point of the frontier: a policy (a sweep point) or best-of-n, with 95% intervals of its reward means."""

    method: str  # "best-of-n" or the policy's algorithm
    label: str  # "n=4", or the point's overrides
    kl: float
    proxy_reward: tuple[float, float, float]  # mean, low, high
    judge_reward: tuple[float, float, float]
    extra: dict[str, float] | None = None  # LC win rate, EOS share, length, ... for a policy

    @property
    def sqrt_kl(self) -> float:
        return math.sqrt(max(self.kl, 0.0))

    def row(self) -> dict[str, float | str]:
        return {
            "method": self.method,
            "point": self.label,
            "kl": self.kl,
            "sqrt_kl": self.sqrt_kl,
            "proxy_reward": self.proxy_reward[0],
            "proxy_reward_ci_low": self.proxy_reward[1],
            "proxy_reward_ci_high": self.proxy_reward[2],
            "judge_reward": self.judge_reward[0],
            "judge_reward_ci_low": self.judge_reward[1],
            "judge_reward_ci_high": self.judge_reward[2],
            **(self.extra or {}),
        }


def best_of_n_frontier(
    proxy: np.ndarray,
    judge: np.ndarray,
    ns: list[int],
    *,
    ended: np.ndarray | None = None,
    missing_eos_penalty: float | None = None,
    clusters: list | None = None,
    seed: int = 0,
) -> list[FrontierPoint]:
    """Best-of-n for each n in `ns`, selected by the objective (`objective_scores`), with bootstrap intervals over
    prompts (over `clusters`, e.g. conversations, when given: one label per prompt). `proxy`, `judge`, `ended`:
    [prompts, samples]. Its "proxy reward" is the objective of the pick; with `ended`, `eos_fraction` is the share of
    picks that ended."""
    objective = objective_scores(proxy, ended, missing_eos_penalty)
    weights = stats.resample_weights(objective.shape[0], clusters, seed=seed)
    points = []
    for n in ns:
        objective_n, judge_n = best_of_n_scores(objective, judge, n)
        extra = None
        if ended is not None:
            extra = {"eos_fraction": float(best_of_n_scores(objective, np.asarray(ended, dtype=float), n)[1].mean())}
        points.append(
            FrontierPoint(
                "best-of-n",
                f"n={n}",
                best_of_n_kl(n),
                stats.mean_with_interval(objective_n, weights),
                stats.mean_with_interval(judge_n, weights),
                extra,
            )
        )
    return points


def frontier_table(points: list[FrontierPoint], objective: str = "proxy") -> str:
    """Markdown: the points, with KL, rewards and intervals, and each point's extras; `objective`
    (`objective_name`) names the optimised reward in the header."""
    extras = sorted({k for p in points for k in (p.extra or {})})

    def interval(v: tuple[float, float, float]) -> str:
        return f"{v[0]:.3f} ({v[1]:.3f} to {v[2]:.3f})"

    lines = [
        f"| method | point | KL (nats) | sqrt KL | optimised reward: {objective} (95% CI) | judge reward (95% CI) | "
        + " | ".join(extras)
        + (" |" if extras else "|"),
        "|---" * (6 + len(extras)) + "|",
    ]
    for p in points:
        cells = [
            p.method,
            p.label,
            f"{p.kl:.2f}",
            f"{p.sqrt_kl:.2f}",
            interval(p.proxy_reward),
            interval(p.judge_reward),
        ]
        cells += [f"{p.extra[k]:.3f}" if p.extra and k in p.extra else "" for k in extras]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def frontier_plot(points: list[FrontierPoint], objective: str = "proxy"):
    """The optimised reward (`objective`, see `objective_name`) and the judge's against sqrt(KL): best-of-n as
    lines, each policy point with its interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharex=True)
    panels = [(axes[0], "proxy_reward", f"optimised: {objective}"), (axes[1], "judge_reward", "judge")]
    for ax, which, title in panels:
        bon = [p for p in points if p.method == "best-of-n"]
        if bon:
            ax.plot(
                [p.sqrt_kl for p in bon], [getattr(p, which)[0] for p in bon], "o-", color="grey", label="best-of-n"
            )
            for p in bon:
                ax.annotate(
                    p.label, (p.sqrt_kl, getattr(p, which)[0]), fontsize=7, xytext=(3, -9), textcoords="offset points"
                )
        for method in sorted({p.method for p in points} - {"best-of-n"}):
            mine = [p for p in points if p.method == method]
            values = np.array([getattr(p, which) for p in mine])
            ax.errorbar(
                [p.sqrt_kl for p in mine],
                values[:, 0],
                yerr=[values[:, 0] - values[:, 1], values[:, 2] - values[:, 0]],
                fmt="s",
                capsize=3,
                label=method,
            )
            for p, v in zip(mine, values[:, 0]):
                ax.annotate(p.label, (p.sqrt_kl, v), fontsize=7, xytext=(3, 4), textcoords="offset points")
        ax.set_title(f"{title}\nreward against sqrt(KL to SFT)", fontsize=9)
        ax.set_xlabel("sqrt(KL), sqrt(nats)")
        ax.set_ylabel("mean normalised reward")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def sample_best_of_n_scores(
    sft, tokenizer, prompts, proxy, judge, sampling, samples: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`samples` responses of the SFT model per prompt, drawn with `sampling` (the evaluation's: `evaluation_sampling`),
    their proxy and judge scores and whether each ended (EOS or a stop string): three [prompts, samples] arrays.
    The raw proxy score is returned, so that the missing-EOS penalty is applied (`best_of_n_frontier`) at whatever
    value the frontier uses, without sampling again."""
    repeated = [p for p in prompts for _ in range(samples)]  # each row of a batch draws its own sample
    outputs = sampling.sample(sft, tokenizer, repeated)
    texts = [t for o in outputs for t in o.texts]
    ended = np.array([bool(e) for o in outputs for e in o.ended]).reshape(len(prompts), samples)
    proxy_scores = np.asarray(proxy.score(repeated, texts), dtype=float).reshape(len(prompts), samples)
    judge_scores = np.asarray(judge.score(repeated, texts), dtype=float).reshape(len(prompts), samples)
    return proxy_scores, judge_scores, ended
