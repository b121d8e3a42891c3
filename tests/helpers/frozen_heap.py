"""Imported last by the tests' fork server (``procs``): moves every object the preloaded modules made into the
collector's permanent generation (``gc.freeze``), as CPython's documentation advises before forking workers.

Without it each forked child's first full collection walks every object torch's import left and writes to each
one's header, so the pages it shares with the server are copied. That cost lands at a random moment of the test's own
work: a test bounding a waiting side to 2 % of a core over 3 s failed on it (figures in commit 81ffd6a). Children
still collect whatever they allocate themselves.
"""

import gc

gc.freeze()
