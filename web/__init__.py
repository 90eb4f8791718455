"""The provenance browser's templates, static assets and view helpers (no registry imports).

The registry renders these pages (``kvgraft.registry``'s UI routes); this package only turns
plain values into escaped HTML and SVG.
"""

from ._internal.render import STATIC_DIR, TEMPLATES_DIR, environment, figure, number, percent, render_page, short_digest
from ._internal.svg import LineageNode, PlotSeries, kl_plot_svg, lineage_svg

__all__ = [
    "STATIC_DIR", "TEMPLATES_DIR", "LineageNode", "PlotSeries", "environment", "figure", "kl_plot_svg",
    "lineage_svg", "number", "percent", "render_page", "short_digest",
]
