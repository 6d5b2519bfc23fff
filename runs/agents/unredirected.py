"""An HTTP opener that follows no redirect, for the remote services a run
posts to (the report's receiver, the model API).

A redirect is the service's answer, not an address to try: urllib would
send the POST's headers (its credentials too) to wherever it points, as a
GET without the body, and take that GET's answer for the service's.  It
surfaces as an HTTPError of its 3xx status."""

from __future__ import annotations

import urllib.request
from typing import Any


class _Unredirected(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


NOT_REDIRECTED = urllib.request.build_opener(_Unredirected)
