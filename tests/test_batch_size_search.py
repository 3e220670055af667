"""ftbench.train.batch_size_search: the search on a stand-in for "does this batch fit" (runs that search against
an injected memory limit: tests/test_faults.py)."""

from __future__ import annotations

from ftbench.train.batch_size_search import search_batch_size


def test_batch_size_search():
    fits_up_to_8 = lambda batch: batch <= 8  # noqa: E731
    assert search_batch_size(fits_up_to_8, 2, 1024) == (8, 16, [[2, True], [4, True], [8, True], [16, False]])
    # The start does not fit: halve until one does.
    assert search_batch_size(fits_up_to_8, 32, 1024) == (8, 16, [[32, False], [16, False], [8, True]])
    # Nothing runs out of memory: stop at the cap, no boundary seen.
    assert search_batch_size(lambda b: True, 8, 100) == (100, None, [[8, True], [16, True], [32, True], [64, True], [100, True]])
    assert search_batch_size(lambda b: True, 500, 100) == (100, None, [[100, True]])
    # Not even one sample fits.
    assert search_batch_size(lambda b: False, 4, 1024) == (None, 1, [[4, False], [2, False], [1, False]])
