"""Evaluation: what the evaluate stage measures, and the decisions and comparisons built on it (docs/evaluation.md).

- compare: a policy against the SFT model, reward models on held-out pairs, challengers against champions;
- held_out: the held-out prompts and the SFT model's answers (the sft_answers stage); answers: ended, cut, degenerate;
- pairs: a reward model or judge on held-out pairs, beside the length rule; judges: the judge kinds; judging: what
  every judge shares, the llm judge and the settings check, without torch;
- metrics: perplexity, sampled KL, win rates, drift, calibration, ranking agreement (each defined once);
- stats: intervals, clustered bootstraps, the length rule, the length-controlled win rate;
- champion: the champion rule; frontier: best-of-n against KL; report and plots: report.md, DVC plots, figures.
"""
