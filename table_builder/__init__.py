"""table_builder."""
