"""Evaluation: what the evaluate stage measures, and the decisions and comparisons built on it.

- compare: a policy against the SFT model on held-out prompts, reward models on held-out pairs, challengers
  against champions (the measurements behind every figure of the evaluate stage);
- held_out: the held-out prompts, and the SFT model's answers to them (the sft_answers stage);
- pairs: a reward model or judge on held-out pairs, beside the length rule;
- report: report.md, the DVC plot tables and the figures;
- metrics: perplexity, sampled KL, win rates, drift, calibration, ranking agreement (each defined once);
- stats: intervals, paired and conversation-clustered bootstraps, the length rule, the length-controlled win rate;
- champion: the champion rule (when a registered challenger replaces the champion);
- frontier: best-of-n against KL, the free baseline curve for policy optimisation;
- plots: the figures.
"""
