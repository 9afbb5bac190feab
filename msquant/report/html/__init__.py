"""The run report as a self-contained HTML page (:func:`~msquant.report.html.page.render_html`)."""
