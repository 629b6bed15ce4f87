"""The former name of `scheduler.model_api`: import from there.

Kept only for `models/ragged_batch.py`, whose import moves with its next edit; then
this module goes.
"""

from scheduler.model_api import TokenBatch  # noqa: F401
