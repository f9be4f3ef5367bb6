"""The pipeline machinery around the ML library (rlhflow): the stage list that drives the Prefect flow and
dvc.yaml (stages, codedeps), whether a stage is up to date and its record (stage_lock), what a run leaves in
MLflow and DVC (run_record) and putting it back (restore), MLflow tracking, the model registry and champion
promotion (tracking, registry, promotion), the pyfunc wrappers that serve registered models (serving), content
hashes (hashing), one run per workspace (workspace) and the harness every stage module runs in (stage_runner).

It imports the ML library; the ML library never imports it.
"""
