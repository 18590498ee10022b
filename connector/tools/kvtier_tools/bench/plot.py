"""PNG plots for the benchmarks; matplotlib is optional (the vLLM venv may not have it)."""

from __future__ import annotations

from typing import Any

NO_MATPLOTLIB = "plot: none written (matplotlib is not installed: pip install matplotlib)"


def pyplot() -> Any | None:
    """``matplotlib.pyplot`` on the file-only Agg backend, or None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display on servers; set before pyplot is imported
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save(plt: Any, fig: Any, path: str) -> str:
    """Write ``fig`` to ``path`` as PNG, free it, and return ``path``."""
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
