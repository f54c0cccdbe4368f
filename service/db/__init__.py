"""The database layer: typed models, engine set-up and migrations."""
