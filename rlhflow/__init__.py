"""The ML library of the RLHF pipeline, in rooms by job, each importing only the rooms listed before it:
config/ (params.yaml), data/ (readers, formats, splits, validation), models/ (loading, policy, decoding,
sampling), training/ (reward model, SFT, trl's algorithms, data parallelism), ppo/ and evaluation/. Below them
all: fsutil (atomic writes) and redaction (credentials out of URLs). It knows nothing of Prefect, DVC or MLflow:
that machinery is rlhfops.
"""
