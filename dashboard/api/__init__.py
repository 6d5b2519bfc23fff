"""The JSON API under /api/: the runs, their items and decisions, read by
viewers and acted on by operators, with the same rules as the pages (the
same filters, the same decision path, the same permission), authenticated
by a user's API token (Authorization: Bearer) or the signed-in session.
Its OpenAPI document is generated from this code (django-ninja) and served
at /api/openapi.json.  docs/API.md shows it in use."""
