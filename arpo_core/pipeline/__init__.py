"""The pipeline's stages as plain functions (one module per stage, each with `run(p, **paths)`) and the
stage table that declares them once (`table.py`, docs/design.md "The stage table")."""
