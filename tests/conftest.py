"""Suite-wide settings.

Hypothesis runs derandomized (a fixed example sequence per test) so CI is reproducible: a property
that fails, fails every run. Set ``GEMMASERVE_HYPOTHESIS_RANDOM=1`` to explore fresh examples.
"""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("deterministic", derandomize=True, print_blob=True)
settings.register_profile("explore", print_blob=True)
settings.load_profile("explore" if os.environ.get("GEMMASERVE_HYPOTHESIS_RANDOM") == "1" else "deterministic")
