"""Alembic migrations: the only way the control plane's schema is created or changed.

`env.py` takes the target metadata from `api.models` and the database URL from the `Settings` the caller passes in
(`api.migrate` puts it, and possibly an open connection, in the Alembic config's `attributes`); run from the alembic
CLI it builds `Settings()` from the environment. Revisions live in `versions/` and are shipped as package data.
"""
