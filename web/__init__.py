"""The provenance browser's templates, static assets and view helpers (no registry imports).

The registry renders these pages (``kvgraft.registry``'s UI routes); this package only turns
plain values into escaped HTML and SVG.
"""

from ._internal.render import (
    STATIC_DIR,
    TEMPLATES_DIR,
    environment,
    figure,
    number,
    percent,
    render_page,
    short_digest,
    visible,
)
from ._internal.shell import REGISTRY_VARIABLE, command, shell_word, url_word
from ._internal.svg import LineageNode, PlotSeries, kl_plot_svg, lineage_svg
from ._internal.views import lineage_view, mean_figure, record_summary, same_figure

__all__ = [
    "REGISTRY_VARIABLE", "STATIC_DIR", "TEMPLATES_DIR", "LineageNode", "PlotSeries", "command", "environment",
    "figure", "kl_plot_svg", "lineage_svg", "lineage_view", "mean_figure", "number", "percent", "record_summary",
    "render_page", "same_figure", "shell_word", "short_digest", "url_word", "visible",
]
