"""The former name of `models.classic_batch`: import from there.

Kept only for `models/ragged_batch.py`, whose import moves with its next edit; then
this module goes.
"""

from models.classic_batch import LiveRow, check_adoptable, check_admissible  # noqa: F401
