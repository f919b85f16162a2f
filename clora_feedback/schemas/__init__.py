"""Wire contracts with outside systems (pydantic models; JSON Schemas exported to `connectors/`)."""
