"""The pipeline's stages, one module each (`python -m tasks.<stage>`; the list is rlhfops/stages.py)."""

# Not empty: every stage has this file as a code dep, and DVC warns about an empty dep each time it records a stage.

import rlhfops  # noqa: E402, F401  (a stage started by a Python without the project's stack stops here, in one line)
