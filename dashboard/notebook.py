"""Panel in a Jupyter kernel without the internet.

Panel's first render of a cell's output puts its stylesheets inline (`pn.extension(inline=True)`),
but a model made later, by a callback (a pressed button, a redrawn plot, a tab opened), points
at Panel's CDN: a class offline saw 8 failed loads of loading.css, markdown.css, default.css and
native.css. Panel rewrites those addresses to a document's `dist_url` when it has one, as it does
itself for the Jupyter server's copy in its "server" resource mode; here every document a cell
showed gets the copy that Panel's Jupyter server extension serves (`panel_dist/`, enabled by
Panel's install), before any callback of it can run.
"""

from __future__ import annotations

import os
from typing import Any

# Where Jupyter serves pages: "/" locally, the user's prefix on JupyterHub and Binder.
_PREFIX_VARIABLE = "JUPYTERHUB_SERVICE_PREFIX"


def local_dist_url(environ: dict[str, str] | None = None) -> str:
    """The address of the Jupyter server's copy of Panel's dist folder."""
    prefix = (os.environ if environ is None else environ).get(_PREFIX_VARIABLE, "/")
    return prefix.rstrip("/") + "/panel_dist/"


def point_documents_at_server(*_: Any) -> int:
    """Give every Panel document shown so far the server's copy; how many were new."""
    from panel.io.state import state

    url, changed = local_dist_url(), 0
    for _viewable, _root, doc, comm in list(state._views.values()):
        if comm is not None and doc._template_variables.get("dist_url") != url:
            doc._template_variables["dist_url"] = url
            changed += 1
    return changed


def serve_styles_locally() -> None:
    """In a Jupyter kernel: after every cell, the documents it showed take Panel's stylesheets
    from the Jupyter server (once per kernel; elsewhere nothing)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if shell is None or getattr(shell, "kernel", None) is None:
        return
    if point_documents_at_server not in shell.events.callbacks["post_run_cell"]:
        shell.events.register("post_run_cell", point_documents_at_server)
