"""matplotlib, loaded only when a plot is drawn: it comes with the ``bench`` extra
(``pip install 'asyncdiloco[bench]'``), so a core install runs every benchmark and the
demo and writes their reports, only without the figures."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


def pyplot() -> Any | None:
    """``matplotlib.pyplot`` on the non-interactive Agg backend, or None (with one warning
    naming the fix) when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        log.warning("plots skipped: matplotlib is not installed (pip install 'asyncdiloco[bench]')")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
