"""The provenance UI's templates, static assets and view helpers, served by the registry.

Not built yet: see the web UI issue.
"""
